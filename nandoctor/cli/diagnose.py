"""`nandoctor diagnose CONFIG`: replay, stop at the first bad step, report."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from nandoctor import diagnose as engine
from nandoctor.cli import options
from nandoctor.cli.app import app, handles_errors
from nandoctor.configfile import load_config
from nandoctor.errors import ExitCode
from nandoctor.io import check_writable, write_text
from nandoctor.render.terminal import StepProgress, print_header, render_report
from nandoctor.report import Report


@app.command()
@handles_errors
def diagnose(
    config: Path = typer.Argument(..., help="The run's YAML config."),
    steps: int | None = options.Steps,
    device: str | None = options.Device,
    dtype: str | None = options.Dtype,
    seed: int | None = options.Seed,
    json_path: str | None = options.Json,
    quiet: bool = options.Quiet,
    debug: bool = options.Debug,
) -> None:
    """Replay the run, stop at the first non-finite step, and say where and why."""
    options.check_distinct_stdout(json_path)
    if json_path:
        check_writable(json_path, "--json")
    loaded = load_config(config).with_overrides(steps=steps, device=device, dtype=dtype, seed=seed)
    console = Console(stderr=options.report_console_to_stderr(json_path), highlight=False)
    progress = StepProgress(console, loaded.config.steps, enabled=not quiet)

    def on_session(session) -> None:
        if not quiet:
            print_header(console, "diagnose", str(config), session)
        progress.__enter__()

    try:
        report = engine.diagnose(loaded, on_session=on_session, on_step=progress.update)
    finally:
        progress.__exit__(None, None, None)
    render_report(console, report, quiet=quiet)
    if json_path:
        write_text(json_path, report.to_json(), "--json")
    raise typer.Exit(int(exit_code(report)))


def exit_code(report: Report) -> ExitCode:
    return {
        "healthy": ExitCode.HEALTHY,
        "nonfinite": ExitCode.NONFINITE,
        "interrupted": ExitCode.INTERRUPTED,
    }.get(report.status, ExitCode.USAGE)
