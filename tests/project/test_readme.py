"""The README's newcomer commands stay true: CI runs the test command it shows."""

from __future__ import annotations

import re

from tests.helpers.paths import REPO


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (REPO / "README.md").read_text())


def test_readme_opens_with_install_and_run_then_tests():
    first, second = readme_commands()[:2]
    assert "pip install" in first
    assert first.endswith("nandoctor diagnose configs/seed-fp16-nan.yaml")
    assert second.endswith("python -m pytest -q")


def test_ci_runs_the_readme_test_command():
    test_command = readme_commands()[1]
    assert test_command in (REPO / ".ci" / "run").read_text()


def test_the_shipped_configs_exist():
    assert (REPO / "configs" / "seed-fp16-nan.yaml").is_file()
    assert (REPO / "configs" / "seed-fixed.yaml").is_file()
