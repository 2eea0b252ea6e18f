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
from nandoctor.io import write_text
from nandoctor.render.markdown import render_markdown
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
    markdown_path: str | None = options.Markdown,
    no_verify: bool = typer.Option(False, "--no-verify", help="Do not replay the fixes."),
    verify_budget: float = typer.Option(
        engine.DEFAULT_VERIFY_BUDGET, "--verify-budget", min=0, help="Seconds for all fix replays."
    ),
    quiet: bool = options.Quiet,
    debug: bool = options.Debug,
) -> None:
    """Replay the run, stop at the first non-finite step, and say where and why."""
    outputs = {"--json": json_path, "--markdown": markdown_path}
    options.check_outputs(outputs)
    loaded = load_config(config).with_overrides(steps=steps, device=device, dtype=dtype, seed=seed)
    console = Console(stderr=options.report_console_to_stderr(*outputs.values()), highlight=False)
    progress = StepProgress(console, loaded.config.steps, enabled=not quiet)

    def on_session(session) -> None:
        if not quiet:
            print_header(console, "diagnose", str(config), session)
        progress.__enter__()

    try:
        report = engine.diagnose(
            loaded,
            on_session=on_session,
            on_step=progress.update,
            verify=not no_verify,
            verify_budget=verify_budget,
        )
    finally:
        progress.__exit__(None, None, None)
    render_report(console, report, quiet=quiet)
    write_reports(report, outputs)
    raise typer.Exit(int(exit_code(report)))


def write_reports(report: Report, outputs: dict[str, str | None]) -> None:
    """Every report asked for, each written atomically."""
    renderers = {"--json": Report.to_json, "--markdown": render_markdown}
    for option, path in outputs.items():
        if path:
            write_text(path, renderers[option](report), option)


def exit_code(report: Report) -> ExitCode:
    return {
        "healthy": ExitCode.HEALTHY,
        "nonfinite": ExitCode.NONFINITE,
        "interrupted": ExitCode.INTERRUPTED,
    }.get(report.status, ExitCode.USAGE)
