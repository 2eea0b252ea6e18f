"""The command line: one small module per command, all added to one typer app."""

from nandoctor.cli import (  # noqa: F401  (each module adds its command)
    baseline,
    compare,
    diagnose,
    lint,
    schema,
    watch,
)
from nandoctor.cli.app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
