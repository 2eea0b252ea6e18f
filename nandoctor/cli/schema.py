"""`nandoctor schema`: the config file's JSON Schema, for editors and validators."""

from __future__ import annotations

import json

import typer

from nandoctor.cli.app import app, handles_errors


@app.command()
@handles_errors  # NB: a full disk or a closed pipe is one line and exit 2, never exit 1
def schema() -> None:
    """Print the JSON Schema of the config file."""
    from nandoctor.setup.schema import Config  # NB: here: pydantic's models take 0.3 s

    document = Config.model_json_schema()
    document["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    document["title"] = "nandoctor config"
    typer.echo(json.dumps(document, indent=2))
