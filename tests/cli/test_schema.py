"""`nandoctor schema` prints a JSON Schema that describes every config key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from tests.helpers.paths import REPO


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


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_is_one_line_and_exit_2_never_exit_1():
    # exit 1 tells CI a NaN was found; a failed write of the schema is the environment's
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "nandoctor", "schema"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
    assert done.returncode == 2
    assert done.stderr.splitlines()[0] == "error: no space left on the device"
    assert "Traceback" not in done.stderr
