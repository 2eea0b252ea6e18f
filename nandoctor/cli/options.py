"""Options shared by several commands (SPEC.md, "Common options")."""

from __future__ import annotations

import typer

from nandoctor.cli.output import check_writable
from nandoctor.errors import UsageError
from nandoctor.setup.dtypes import canonical_dtype
from nandoctor.setup.schema import check_device


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
    try:
        return check_device(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def report_console_to_stderr(*paths: str | None) -> bool:
    """Human output moves to stderr when a report is written to stdout (`-`)."""
    return any(p == "-" for p in paths)


def check_outputs(outputs: dict[str, str | None]) -> None:
    """Before a long run: at most one report on stdout, and every folder writable."""
    if sum(p == "-" for p in outputs.values()) > 1:
        raise UsageError("only one report can be written to stdout ('-')")
    for option, path in outputs.items():
        if path:
            check_writable(path, option)


Steps = typer.Option(
    None, "--steps", min=1, help="Optimizer steps to replay (default: the config's)."
)
Device = typer.Option(None, "--device", callback=device_name, help="auto | cpu | cuda | cuda:N")
Dtype = typer.Option(
    None, "--dtype", callback=dtype_name, help="fp16 | bf16 | fp32 (or full names)"
)
Seed = typer.Option(None, "--seed", min=0, help="Seed for Python, numpy and torch.")
Json = typer.Option(None, "--json", help="Write the JSON report here ('-' for stdout).")
Markdown = typer.Option(None, "--markdown", help="Write a Markdown report here ('-' for stdout).")
Junit = typer.Option(None, "--junit", help="Write a JUnit XML report here, for CI test reporters.")
TimeBudget = typer.Option(
    None, "--time-budget", min=0, help="Stop the run after this many seconds; judge the steps done."
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
