"""Options shared by several commands (SPEC.md, "Common options")."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from nandoctor.cli.output import check_not_input, check_writable, refuse_an_option, resolved
from nandoctor.errors import UsageError
from nandoctor.setup.dtypes import canonical_dtype
from nandoctor.setup.limits import MAX_STEPS

if TYPE_CHECKING:
    from nandoctor.setup.load import LoadedConfig


def a_number(value: float | None) -> float | None:
    """A budget or tolerance: `inf` means no limit, but `nan` means nothing (every
    comparison with it is false: `--replay-budget nan` replayed always)."""
    if value is not None and math.isnan(value):
        raise typer.BadParameter("expected a number, got nan")
    return value


def seconds(value: float | None) -> float | None:
    """`--time-budget`: 0 seconds would stop the run before its first step, and was
    read as no budget at all; a budget is a number of seconds above 0 (or `inf`)."""
    value = a_number(value)
    if value is not None and value <= 0:
        raise typer.BadParameter(f"{value:g}: expected a number of seconds above 0")
    return value


def dtype_name(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        return canonical_dtype(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def device_name(value: str | None) -> str | None:
    if value is None:
        return None
    from nandoctor.setup.schema import check_device  # NB: pydantic's models take 0.3 s

    try:
        return check_device(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def policy_name(value: str | None) -> str | None:
    if value is None or value in ("cuda", "native"):
        return value
    raise typer.BadParameter(f"{value!r}: expected cuda or native")


def report_console_to_stderr(*paths: str | None) -> bool:
    """Human output moves to stderr when a report is written to stdout (`-`)."""
    return any(p == "-" for p in paths)


def check_outputs(outputs: dict[str, str | None]) -> dict[str, str | None]:
    """Before a long run: at most one report on stdout, and every folder writable. Each
    path is made absolute in place (and returned): the user's code may `chdir`."""
    if sum(p == "-" for p in outputs.values()) > 1:
        raise UsageError("only one report can be written to stdout ('-')")
    seen: dict[str, str] = {}
    for option, path in outputs.items():
        if path is not None:
            check_writable(path, option)
            outputs[option] = resolved(path)
            if path != "-" and (same := seen.get(os.path.realpath(path))):
                raise UsageError(f"{same} and {option} name the same file: {path}")
            seen[os.path.realpath(path)] = option
    return outputs


def checked_logdir(logdir: str | None, outputs: dict[str, str | None]) -> str | None:
    """`--tensorboard`'s folder, absolute (the user's code may `chdir`), checked before a
    long run: tensorboard installed, the folder writable, and not a report's path (the
    report could not be written over the folder the writer made)."""
    if logdir is None:
        return None
    if not logdir:
        raise UsageError("--tensorboard: expected a folder, got an empty string")
    refuse_an_option(logdir, "--tensorboard")
    from nandoctor.render import tensorboard  # NB: not for every command's start-up

    logdir = resolved(logdir)
    tensorboard.require_tensorboard(logdir)
    for option, path in outputs.items():
        if path and path != "-" and os.path.realpath(path) == os.path.realpath(logdir):
            raise UsageError(f"{option} and --tensorboard name the same path: {path}")
    return logdir


def protect_inputs(
    outputs: dict[str, str | None], loaded: LoadedConfig, **others: str | None
) -> None:
    """No report may overwrite the config, its checkpoint, a file entrypoint or another
    file the command reads (`baseline=`) (exit 2)."""
    inputs = run_inputs(loaded)
    inputs.update({name: Path(path) for name, path in others.items() if path})
    for option, path in outputs.items():
        check_not_input(path, option, inputs)


def run_inputs(loaded: LoadedConfig) -> dict[str, Path]:
    """The run's own files, by what they are: the config, the checkpoint, the files its
    entrypoints name (`train.py:build_model`)."""
    config, base = loaded.config, loaded.base_dir
    inputs = {"config": loaded.path}
    if config.checkpoint:
        inputs["checkpoint"] = base / config.checkpoint
    for key in ("model", "data", "loss"):
        entry = getattr(config, key, None)
        if isinstance(entry, str) and ":" in entry and entry.split(":")[0].endswith(".py"):
            inputs[f"{key} source {entry.split(':')[0]}"] = base / entry.split(":")[0]
    return inputs


Steps = typer.Option(
    None,
    "--steps",
    min=1,
    max=MAX_STEPS,
    help="Optimizer steps to replay (default: the config's).",
)
Device = typer.Option(None, "--device", callback=device_name, help="auto | cpu | cuda | cuda:N")
Dtype = typer.Option(
    None, "--dtype", callback=dtype_name, help="fp16 | bf16 | fp32 (or full names)"
)
AutocastPolicy = typer.Option(
    None,
    "--autocast-policy",
    callback=policy_name,
    help="cuda: CUDA's autocast cast lists on any device (default) | native: the device's own.",
)
Seed = typer.Option(None, "--seed", min=0, max=2**32 - 1, help="Seed for Python, numpy and torch.")
Json = typer.Option(None, "--json", help="Write the JSON report here ('-' for stdout).")
Markdown = typer.Option(None, "--markdown", help="Write a Markdown report here ('-' for stdout).")
Junit = typer.Option(None, "--junit", help="Write a JUnit XML report here, for CI test reporters.")
TimeBudget = typer.Option(
    None,
    "--time-budget",
    callback=seconds,
    help="Stop the run after this many seconds; judge the steps done.",
)
Quiet = typer.Option(False, "--quiet", "-q", help="A few lines of output, for CI logs.")
Debug = typer.Option(False, "--debug", help="Show Python tracebacks for errors.")
TensorBoard = typer.Option(
    None, "--tensorboard", help="Write the per-step telemetry here as TensorBoard scalars."
)
FailOnDivergence = typer.Option(
    False,
    "--fail-on-divergence",
    help="Exit 1 when the loss or gradient norm diverged, even if every value stayed finite.",
)
FailOnForecast = typer.Option(
    False,
    "--fail-on-forecast",
    help="Exit 1 when a forecast was made (a failure seen coming), even if every value "
    "stayed finite.",
)
