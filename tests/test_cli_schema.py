"""`nandoctor schema` prints a JSON Schema that describes every config key."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from nandoctor.cli import app


def test_schema_lists_every_key_and_requires_the_essentials():
    result = CliRunner().invoke(app, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    keys = {
        "name", "python_path", "model", "model_args", "data", "data_args", "loss", "optimizer",
        "scheduler", "precision", "clip_grad_norm", "steps", "device", "seed", "checkpoint",
    }  # fmt: skip
    assert keys <= set(schema["properties"])
    assert set(schema["required"]) == {"model", "data", "optimizer"}
    assert schema["additionalProperties"] is False
