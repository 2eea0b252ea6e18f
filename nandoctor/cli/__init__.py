"""The command line: one small module per command, all added to one typer app."""

from nandoctor.cli import (  # noqa: F401  (each module adds its command)
    baseline,
    compare,
    diagnose,
    lint,
    schema,
    watch,
)
from nandoctor.cli.app import app, end_past_user_threads


def main() -> None:
    try:
        app()
    except SystemExit as e:
        end_past_user_threads(e.code)
        raise


__all__ = ["app", "main"]
