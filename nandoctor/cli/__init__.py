"""The command line: one small module per command, all added to one typer app."""

from nandoctor.cli import (  # noqa: F401  (each module adds its command)
    baseline,
    compare,
    diagnose,
    lint,
    schema,
    watch,
)
from nandoctor.cli.app import app, end_before_teardown, run_app


def main() -> None:
    try:
        code = run_app()
    except SystemExit as e:
        end_before_teardown(e.code)
        raise
    end_before_teardown(code)
    raise SystemExit(code)


__all__ = ["app", "main"]
