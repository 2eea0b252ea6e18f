"""`nandoctor lint PATH...`: static checks of training scripts for the NaN anti-patterns."""

from __future__ import annotations

from pathlib import Path

import typer

from nandoctor.cli import options
from nandoctor.cli.app import app, cli_console, handles_errors
from nandoctor.cli.outcome import Outcome
from nandoctor.cli.output import write_text
from nandoctor.errors import UsageError
from nandoctor.lint.findings import LintResult, Severity  # NB: the rest when linting (below)

READ_SUFFIXES = (".py", ".pyi", ".ipynb")  # what lint reads: never a report's path


@app.command()
@handles_errors
def lint(
    paths: list[Path] = typer.Argument(
        ..., help="Python files and notebooks, or folders to search for *.py and *.ipynb."
    ),
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
    _refuse_sources(outputs, paths)
    config = load_config(paths, select=select, ignore=ignore, fail_on=fail_on)
    result = lint_paths(paths, config)
    stderr = options.report_console_to_stderr(*outputs.values())
    terminal.render(cli_console(stderr=stderr, soft_wrap=True), result, quiet=quiet)
    write_reports(result, outputs)
    return Outcome(found=result.fails(config.fail_on))


def _refuse_sources(outputs: dict[str, str | None], paths: list[Path]) -> None:
    """No report may overwrite what lint reads: a script or notebook (`--json train.py
    other.py` takes train.py for the report's path), a path it was given, or a
    pyproject.toml (exit 2)."""
    given = {p.resolve() for p in paths}
    for option, path in outputs.items():
        target = Path(path) if path and path != "-" else None
        if target is None or not target.is_file():
            continue
        if (
            target.suffix in READ_SUFFIXES
            or target.name == "pyproject.toml"
            or target.resolve() in given
        ):
            report = "report.json" if option == "--json" else "report.sarif"
            raise UsageError(
                f"{option} {path}: is a file lint reads; refusing to overwrite it",
                hint=f"name a new file for the report: nandoctor lint {option} {report} PATH...",
            )


def write_reports(result: LintResult, outputs: dict[str, str | None]) -> None:
    """Every report asked for, each written atomically."""
    from nandoctor.lint.render.json_report import to_json
    from nandoctor.lint.render.sarif import to_sarif

    renderers = {"--json": to_json, "--sarif": to_sarif}
    for option, path in outputs.items():
        if path:
            write_text(path, renderers[option](result), option)
