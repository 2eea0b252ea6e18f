"""`nandoctor compare` on the command line: exit codes, JSON, missing matplotlib."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from tests.helpers.project import base_config

runner = CliRunner()


def test_healthy_runs_exit_0_with_a_table(project):
    result = runner.invoke(app, ["compare", str(project(base_config(steps=4))), "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    assert "float32" in result.output and "bfloat16" in result.output and "verdict" in result.output


def test_a_nonfinite_run_exits_1_and_json_to_stdout(project):
    path = project(base_config(steps=4, data_args={"nan_at": 1}))
    result = runner.invoke(app, ["compare", str(path), "--dtype", "bf16", "--json", "-", "-q"])
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert [r["first_nonfinite_step"] for r in data["runs"]] == [1, 1]


def test_plot_without_matplotlib_is_a_clear_usage_error(project, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = runner.invoke(
        app, ["compare", str(project(base_config(steps=2))), "--plot", "out.png"]
    )
    assert result.exit_code == 2
    assert "--plot needs matplotlib" in result.output and "nandoctor[plot]" in result.output


def test_unknown_dtype_is_a_usage_error(project):
    result = runner.invoke(app, ["compare", str(project(base_config())), "--dtype", "int8"])
    assert result.exit_code == 2 and "unknown dtype 'int8'" in result.output


def test_junit_has_one_case_per_dtype(project, tmp_path):
    import xml.etree.ElementTree as ET

    path = project(base_config(steps=4, data_args={"nan_at": 1}))
    out = tmp_path / "compare.xml"
    result = runner.invoke(
        app, ["compare", str(path), "--dtype", "bf16", "--junit", str(out), "-q"]
    )
    assert result.exit_code == 1
    suite = ET.parse(out).getroot().find("testsuite")
    assert float(suite.get("time")) > 0  # the runs' wall time, as diagnose's
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert set(cases) == {"float32", "bfloat16"}
    assert cases["bfloat16"].find("failure").get("message") == "non-finite at step 1, phase input"


@pytest.mark.parametrize("dtypes", [[], ["--dtype", "fp32"]], ids=["none", "its own"])
def test_a_comparison_with_nothing_to_compare_against_is_a_usage_error(project, dtypes):
    # one dtype's run cannot say that changing the dtype will not help
    result = runner.invoke(app, ["compare", str(project(base_config())), *dtypes])
    assert result.exit_code == 2, result.output
    assert "compare: nothing to compare the config's float32 with" in result.output


ENDING_LOSS = """
import sys
import torch.nn.functional as F
from train import build_model, build_data

CALLS = []


def ends_at_step_two(model, batch, how="exit"):
    CALLS.append(1)
    if len(CALLS) == 3:
        if how == "exit":
            sys.exit(0)
        raise RuntimeError("the user's loss broke")
    x, y = batch
    return F.cross_entropy(model(x), y)


def raises_at_step_two(model, batch):
    return ends_at_step_two(model, batch, how="raise")
"""


@pytest.mark.parametrize("loss", ["ends_at_step_two", "raises_at_step_two"])
def test_a_run_the_users_code_ends_writes_the_comparison_so_far_and_exits_3(
    project, tmp_path, monkeypatch, loss
):
    """A CI job's `if: always()` step reads the reports: sys.exit or an exception in the
    config's run wrote none (exit 3)."""
    path = project(base_config(steps=4, loss=f"ending.py:{loss}"))
    (tmp_path / "ending.py").write_text(ENDING_LOSS)
    monkeypatch.syspath_prepend(str(tmp_path))
    out, junit = tmp_path / "c.json", tmp_path / "c.xml"
    args = ["compare", str(path), "--dtype", "bf16", "--json", str(out), "--junit", str(junit)]
    result = runner.invoke(app, [*args, "-q"])
    assert result.exit_code == 3, result.output
    comparison = json.loads(out.read_text())
    (run,) = comparison["runs"]  # NB: the other dtypes were not run
    assert (run["dtype"], run["status"], run["steps_completed"]) == ("float32", "error", 2)
    assert comparison["verdict"].startswith("the float32 run: loss (step 2) ")
    assert comparison["verdict"].endswith("; no verdict")
    assert "<error" in junit.read_text()
    if loss == "ends_at_step_two":  # NB: the other prints your frames and the error instead
        assert result.stdout.splitlines()[0].endswith(": ERROR")
