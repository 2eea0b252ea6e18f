"""What `nandoctor diagnose` reports for the config a script mirrors: computed once per
test session, through the command line (the contract), so tests compare like with like."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from typer.testing import CliRunner

from nandoctor.cli import app
from tests.helpers.paths import CONFIGS

SCRIPTS = Path(__file__).resolve().parent
SEED_SCRIPT = SCRIPTS / "seed_fp16_nan.py"


@functools.cache
def seed_diagnosis() -> dict:
    """`diagnose configs/seed-fp16-nan.yaml --json` (no fix verification: not compared)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "report.json"
        config = str(CONFIGS / "seed-fp16-nan.yaml")
        args = ["diagnose", config, "--no-verify", "--quiet", "--json", str(out)]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, result.output
        return json.loads(out.read_text())


def line_of(path: Path, text: str) -> int:
    """The 1-based line of `path` that contains `text`."""
    lines = path.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)
