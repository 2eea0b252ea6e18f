"""A CI job: record a baseline on a healthy run, gate later runs on it; a change that
doubles one layer's weights where float16 has little range left fails the gate and names
that layer, before any NaN; the same change far from the limit passes."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.gate.baseline import read_baseline
from tests.helpers.project import base_config

runner = CliRunner()
GAIN = 100.0  # fc1's weights scaled: activations in the thousands, a few % of 65504

SCALED = """
import torch
from torch import nn


def build_model(double=None, gain=1.0):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(8, 16))
    model.add_module("act", nn.ReLU())
    model.add_module("fc2", nn.Linear(16, 16))
    model.add_module("act2", nn.ReLU())
    model.add_module("head", nn.Linear(16, 3))
    with torch.no_grad():
        model.fc1.weight.mul_(gain)  # NB: large activations: float16's range matters
        if double:
            getattr(model, double).weight.mul_(2.0)
    return model
"""


def config(project, tmp_path, fp16=False, **model_args):
    (tmp_path / "scaled.py").write_text(SCALED)
    precision = {"dtype": "float16", "grad_scaler": True} if fp16 else {"dtype": "float32"}
    return project(
        base_config(
            model="scaled.py:build_model", model_args=model_args, steps=12, precision=precision
        )
    )


def test_baseline_round_trip_and_stable_key_order(project, tmp_path):
    out = tmp_path / "baseline.json"
    result = runner.invoke(
        app, ["baseline", str(config(project, tmp_path)), "--out", str(out), "-q"]
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("nandoctor baseline ")  # the command that ran, -q
    assert result.stdout.endswith(f"baseline of 12 steps written to {out}\n")
    text = out.read_text()
    data = json.loads(text)
    assert data["format"] == "nandoctor-baseline" and data["schema_version"] == 1
    assert data["dtype"] == "float32" and data["autocast_policy"] == "cuda"  # the default
    assert data["grad_scaler"] is False
    assert list(data) == sorted(data)  # diff-friendly
    baseline = read_baseline(str(out))
    assert baseline.health.steps == 12 and {m.module for m in baseline.health.modules} >= {
        "fc1",
        "fc2",
    }
    assert baseline.to_json() == text


def record(path, out) -> None:
    result = runner.invoke(app, ["baseline", str(path), "--out", str(out), "-q"])
    assert result.exit_code == 0 and out.exists(), result.output


def gated(path, out, *options: str) -> tuple[int, dict]:
    """The exit code and the JSON report of `diagnose --baseline out`."""
    args = ["diagnose", str(path), "--baseline", str(out), "--json", "-", "-q", *options]
    result = runner.invoke(app, args)
    return result.exit_code, json.loads(result.stdout)


# every opt-in comparison, at its tightest: no growth, no loss increase at all
TIGHTEST = ("--max-activation-growth", "1", "--max-gradient-growth", "1")
TIGHTEST += ("--max-loss-increase", "0")


def test_the_same_run_passes_its_baseline(project, tmp_path):
    """Same config, same seed: the same numbers, so every comparison passes even with no
    margin at all (a gate that read another run, or none, would not say 1.00x)."""
    path, out = config(project, tmp_path), tmp_path / "b.json"
    record(path, out)
    code, report = gated(path, out, *TIGHTEST)
    assert code == 0 and report["status"] == "healthy"
    gate = report["gate"]
    assert gate["baseline"] == str(out)
    checks = {c["name"]: c for c in gate["checks"]}
    assert list(checks) == [
        "headroom loss",
        "scaler skips",
        "activation growth",
        "gradient growth",
        "gradient norm",
        "final loss",
    ]
    assert all(c["passed"] for c in checks.values()), checks
    assert ", 1.00x the baseline's " in checks["gradient norm"]["message"]
    final = re.fullmatch(
        r"final loss (\S+) \(baseline (\S+), limit \S+\)", checks["final loss"]["message"]
    )
    assert final is not None and final[1] == final[2]


def test_doubling_one_layer_far_from_the_limit_passes(project, tmp_path):
    """The change the next test fails, in the same float16 run without its large
    activations: the gate sees fc2's activations double (an opt-in growth limit flags
    them), and passes the run by default, since its peaks stay far from 65504."""
    out = tmp_path / "b.json"
    record(config(project, tmp_path, fp16=True), out)
    changed = config(project, tmp_path, fp16=True, double="fc2")
    code, report = gated(changed, out)
    assert code == 0, report["gate"]
    checks = {c["name"]: c for c in report["gate"]["checks"]}
    assert {"headroom", "headroom loss"} <= set(checks)
    assert all(c["passed"] for c in checks.values()), checks
    code, report = gated(changed, out, "--max-activation-growth", "1.5")
    assert code == 1
    (failed,) = [c for c in report["gate"]["checks"] if not c["passed"]]
    assert failed["name"] == "activation growth"
    assert failed["message"].startswith("fc2 (Linear) activations peaked at")


def test_doubling_one_layer_near_the_float16_limit_fails_the_gate_naming_it(project, tmp_path):
    out, junit = tmp_path / "b.json", tmp_path / "junit.xml"
    base = config(project, tmp_path, fp16=True, gain=GAIN)
    record(base, out)
    changed = config(project, tmp_path, fp16=True, gain=GAIN, double="fc2")
    result = runner.invoke(
        app,
        [
            "diagnose",
            str(changed),
            "--baseline",
            str(out),
            "--junit",
            str(junit),
            "--json",
            "-",
            "-q",
        ],
    )
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["status"] == "healthy"  # no NaN: a regression caught before it
    failed = [c for c in report["gate"]["checks"] if not c["passed"]]
    assert failed[0]["name"] == "headroom loss" and failed[0]["message"].startswith(
        "fc2 (Linear) activations peaked at"
    )
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["headroom loss"].find("failure").get("message").startswith("fc2 (Linear)")


def test_an_unhealthy_run_writes_no_baseline(project, tmp_path):
    out = tmp_path / "b.json"
    path = project(base_config(data_args={"nan_at": 1}))
    result = runner.invoke(app, ["baseline", str(path), "--out", str(out), "-q"])
    assert result.exit_code == 1 and not out.exists()
    assert "no baseline written" in result.output


def test_a_run_that_diverged_writes_no_baseline(project, tmp_path):
    """Finite but exploding (least squares at a learning rate that doubles the loss each
    step): its peaks would let every later explosion pass the gate."""
    from tests.report.test_divergence import REGRESSION, regression

    path, out = project(regression(0.8), REGRESSION), tmp_path / "b.json"
    result = runner.invoke(app, ["baseline", str(path), "--out", str(out), "-q"])
    assert result.exit_code == 1, result.output
    assert ": HEALTHY, DIVERGED" in result.output
    assert "no baseline written: the run diverged" in result.output and not out.exists()
    steady = project(regression(0.05), REGRESSION)  # the same run, trained well
    result = runner.invoke(app, ["baseline", str(steady), "--out", str(out), "-q"])
    assert result.exit_code == 0 and out.exists(), result.output


def test_a_missing_or_foreign_baseline_is_a_usage_error(project, tmp_path):
    path = project(base_config())
    result = runner.invoke(app, ["diagnose", str(path), "--baseline", str(tmp_path / "none.json")])
    assert result.exit_code == 2 and "file not found" in result.output
    (tmp_path / "other.json").write_text('{"hello": 1}')
    result = runner.invoke(app, ["diagnose", str(path), "--baseline", str(tmp_path / "other.json")])
    assert result.exit_code == 2 and "not a nandoctor baseline" in result.output


def test_a_damaged_baseline_names_the_key(project, tmp_path):
    path, out = config(project, tmp_path), tmp_path / "b.json"
    runner.invoke(app, ["baseline", str(path), "--out", str(out), "-q"])
    data = json.loads(out.read_text())
    data["health"]["modules"] = "fc1"
    out.write_text(json.dumps(data))
    result = runner.invoke(app, ["diagnose", str(path), "--baseline", str(out), "-q"])
    assert result.exit_code == 2
    assert f"--baseline {out}: malformed baseline: health.modules: " in result.output


def test_a_baseline_of_another_dtype_is_refused_before_the_run(project, tmp_path):
    path, out, report = config(project, tmp_path), tmp_path / "b.json", tmp_path / "r.json"
    runner.invoke(app, ["baseline", str(path), "--out", str(out), "-q"])
    args = ["diagnose", str(path), "--dtype", "bf16", "--baseline", str(out), "--json"]
    result = runner.invoke(app, [*args, str(report), "-q"])
    assert result.exit_code == 2, result.output
    assert f"--baseline {out}: recorded in float32, this run trains in bfloat16" in result.output
    assert "Traceback" not in result.output and not report.exists()


def test_a_baseline_of_another_model_is_refused_before_the_run(project, tmp_path):
    """Module by module, a baseline of another model compares nothing: every run passed."""
    path, out = config(project, tmp_path), tmp_path / "b.json"
    runner.invoke(app, ["baseline", str(path), "--out", str(out), "-q"])
    (tmp_path / "other.py").write_text(
        "import torch\ndef build_model():\n    return torch.nn.Sequential(torch.nn.Linear(8, 3))\n"
    )
    other = project(base_config(model="other.py:build_model", precision={"dtype": "float32"}))
    result = runner.invoke(app, ["diagnose", str(other), "--baseline", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert f"--baseline {out}: recorded from another model ({path})" in result.output
    assert "none of its" in result.output and "modules is in this run's" in result.output
    assert "(not in this run: act ReLU, act2 ReLU, fc1 Linear, ...;" in result.output
    assert "this run's: 0 Linear)" in result.output


def test_time_budget_stops_the_run_and_judges_what_ran(project):
    path = project(base_config(steps=100000))
    result = runner.invoke(app, ["diagnose", str(path), "--time-budget", "1", "--json", "-", "-q"])
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert 0 < report["steps_completed"] < 100000
    assert any(n.startswith("time budget: stopped after") for n in report["notes"])
