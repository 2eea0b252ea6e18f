"""`nandoctor lint PATH...`: static checks of training scripts for the NaN anti-patterns."""

from __future__ import annotations

from pathlib import Path

import typer

from nandoctor.cli import options
from nandoctor.cli.app import app, cli_console, handles_errors
from nandoctor.cli.outcome import Outcome
from nandoctor.cli.output import write_text
from nandoctor.lint.findings import LintResult, Severity  # NB: the rest when linting (below)


@app.command()
@handles_errors
def lint(
    paths: list[Path] = typer.Argument(..., help="Python files, or folders to search for *.py."),
    select: list[str] | None = typer.Option(
        None, "--select", help="Only these check ids (comma-separated or repeated)."
    ),
    ignore: list[str] | None = typer.Option(
        None, "--ignore", help="Skip these check ids (added to pyproject.toml's list)."
    ),
    fail_on: Severity | None = typer.Option(
        None, "--fail-on", help="Lowest severity that makes the exit code 1 (default: warning)."
    ),
    json_path: str | None = options.Json,
    sarif_path: str | None = typer.Option(
        None, "--sarif", help="Write SARIF 2.1.0 here, for GitHub code scanning ('-': stdout)."
    ),
    quiet: bool = options.Quiet,
    debug: bool = options.Debug,
) -> Outcome:
    """Check training scripts for the patterns that turn a loss NaN; exit 1 on findings."""
    # NB: imported here, not with the app: every other command would load the engine too
    from nandoctor.lint import lint_paths, load_config
    from nandoctor.lint.render import terminal

    outputs = {"--json": json_path, "--sarif": sarif_path}
    options.check_outputs(outputs)
    config = load_config(paths, select=select, ignore=ignore, fail_on=fail_on)
    result = lint_paths(paths, config)
    stderr = options.report_console_to_stderr(*outputs.values())
    terminal.render(cli_console(stderr=stderr, soft_wrap=True), result, quiet=quiet)
    write_reports(result, outputs)
    return Outcome(found=result.fails(config.fail_on))


def write_reports(result: LintResult, outputs: dict[str, str | None]) -> None:
    """Every report asked for, each written atomically."""
    from nandoctor.lint.render.json_report import to_json
    from nandoctor.lint.render.sarif import to_sarif

    renderers = {"--json": to_json, "--sarif": to_sarif}
    for option, path in outputs.items():
        if path:
            write_text(path, renderers[option](result), option)
