"""`nandoctor compare CONFIG --dtype bf16 [--dtype fp32 ...]`: the same run per dtype."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from nandoctor.cli import options
from nandoctor.cli.app import app, cli_console, handles_errors
from nandoctor.cli.diagnose import launch_ranks
from nandoctor.cli.outcome import Outcome, of_comparison
from nandoctor.cli.output import write_bytes, write_text
from nandoctor.errors import UsageError, UserCodeError

if TYPE_CHECKING:
    from nandoctor.render.terminal import StepProgress
    from nandoctor.report.comparison import Comparison


@app.command()
@handles_errors
def compare(
    config: Path = typer.Argument(..., help="The run's YAML config."),
    dtypes: list[str] = typer.Option(
        [],
        "--dtype",
        callback=lambda v: [options.dtype_name(d) for d in v],
        help="Also run this dtype (repeatable).",
    ),
    steps: int | None = options.Steps,
    device: str | None = options.Device,
    autocast_policy: str | None = options.AutocastPolicy,
    seed: int | None = options.Seed,
    json_path: str | None = options.Json,
    markdown_path: str | None = options.Markdown,
    junit_path: str | None = options.Junit,
    plot_path: str | None = typer.Option(
        None, "--plot", help="Write a PNG of loss and grad norm per dtype."
    ),
    quiet: bool = options.Quiet,
    debug: bool = options.Debug,
    tensorboard_dir: str | None = options.TensorBoard,
) -> Outcome:
    """Replay the same batches under the config's dtype and each --dtype, side by side."""
    # NB: imported here, so that --help stays free of torch
    from nandoctor.compare import engine
    from nandoctor.render import tensorboard
    from nandoctor.render.compare import render_comparison
    from nandoctor.render.plot import require_matplotlib
    from nandoctor.render.terminal import StepProgress
    from nandoctor.runtime.host_memory import keep_freed_memory
    from nandoctor.setup import distributed
    from nandoctor.setup.load import load_config

    outputs = {"--json": json_path, "--markdown": markdown_path, "--junit": junit_path}
    outputs["--plot"] = plot_path
    options.check_outputs(outputs)
    if plot_path:
        require_matplotlib()
    tensorboard_dir = options.checked_logdir(tensorboard_dir, outputs)
    loaded = load_config(config).with_overrides(
        steps=steps, device=device, seed=seed, autocast_policy=autocast_policy
    )
    options.protect_inputs(outputs, loaded)
    own = loaded.config.precision.dtype
    if all(d == own for d in dtypes):  # NB: one dtype's run says nothing about the others
        raise UsageError(
            f"compare: nothing to compare the config's {own} with",
            hint="name another dtype: --dtype bf16 (repeatable: --dtype bf16 --dtype fp32)",
        )
    nproc = loaded.config.distributed.nproc_per_node
    if nproc > 1 and not distributed.under_launcher():  # as diagnose: one job of N ranks
        return launch_ranks(loaded, nproc)
    quiet = quiet or distributed.current_rank() != 0  # rank 0 speaks for the job
    console = cli_console(stderr=options.report_console_to_stderr(*outputs.values()))

    progress: list[StepProgress] = []

    def on_run(dtype: str, session) -> None:
        if progress:
            progress[-1].__exit__(None, None, None)
        if not quiet:
            console.print(f"[bold]{dtype}[/] on {session.device}")
        progress.append(StepProgress(console, loaded.config.steps, enabled=not quiet).__enter__())

    keep_freed_memory()  # NB: as diagnose: the runs' steps reuse what they free
    started = time.perf_counter()
    try:
        comparison = engine.compare(
            loaded, dtypes, on_run=on_run, on_step=lambda v: progress[-1].update(v)
        )
    except UserCodeError as e:  # NB: raised in a run: the comparison so far first (exit 3)
        if e.report is not None:
            write_outputs(e.report, outputs, seconds=time.perf_counter() - started)
        raise
    finally:
        if progress:
            progress[-1].__exit__(None, None, None)
    if distributed.current_rank() != 0:
        return Outcome()
    render_comparison(console, comparison, quiet=quiet)
    if tensorboard_dir:
        tensorboard.write_comparison(comparison, tensorboard_dir)
    write_outputs(comparison, outputs, seconds=time.perf_counter() - started)
    return of_comparison(comparison)


def write_outputs(
    comparison: Comparison, outputs: dict[str, str | None], seconds: float = 0.0
) -> None:
    """Every report asked for; `seconds`: the runs' wall time, for JUnit's `time`."""
    from nandoctor.render.junit import render_comparison_junit
    from nandoctor.render.markdown import render_comparison_markdown
    from nandoctor.render.plot import plot_png

    if outputs["--json"]:
        write_text(outputs["--json"], comparison.to_json(), "--json")
    if outputs["--markdown"]:
        write_text(outputs["--markdown"], render_comparison_markdown(comparison), "--markdown")
    if outputs["--junit"]:
        write_text(outputs["--junit"], render_comparison_junit(comparison, seconds), "--junit")
    if outputs["--plot"]:
        write_bytes(outputs["--plot"], plot_png(comparison), "--plot")
