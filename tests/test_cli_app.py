"""The command line starts fast where users call it often: `--help`, every command's
`--help`, `schema` and `lint` (a pre-commit hook) never import torch, which alone takes
seconds to load; only the commands that run a model do."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

PROBE = """
import sys
from nandoctor.cli import app
try:
    app(sys.argv[1:])
except SystemExit:
    pass
print("torch loaded:", "torch" in sys.modules, file=sys.stderr)
"""


def loads_torch(*args: str) -> bool:
    """Run the CLI in a fresh interpreter; did anything import torch?"""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=REPO
    )
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("torch loaded:"), done.stderr
    return line.endswith("True")


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["diagnose", "--help"],
        ["compare", "--help"],
        ["watch", "--help"],
        ["baseline", "--help"],
        ["schema"],
        ["lint", "nandoctor/examples/seed.py"],
    ],
    ids=" ".join,
)
def test_help_schema_and_lint_never_import_torch(args):
    assert not loads_torch(*args)


def test_the_cli_never_needs_the_click_package():
    """typer vends its own click: a plain install may have no `click` package at all."""
    code = "import sys; from nandoctor.cli import app; print('click' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.stdout.strip() == "False", done.stderr


def test_a_command_that_runs_a_model_does_import_it(tmp_path):
    # the probe above can tell: a diagnose that reaches the config's model loads torch
    config = REPO / "configs" / "seed-fixed.yaml"
    assert loads_torch("diagnose", str(config), "--steps", "1", "--no-verify", "--quiet")
