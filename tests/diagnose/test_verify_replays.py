"""A what-if replay's verdict is the verdict of a plain run of the fixed config: the same
judge (each GradScaler skip rechecked at loss scale 1), and a learning check that reads
any loss, in units of the original run's own progress. The runs are in
tests/helpers/replay_runs.py."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.report.types import Report
from nandoctor.setup.load import load_config
from tests.helpers import replay_runs


def write(tmp_path: Path, name: str, **config) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"device": "cpu", **config}, sort_keys=False))
    return path


def documents(tmp_path: Path, lr: float, name: str = "documents") -> Path:
    """The bag-of-words classifier in float16 with a GradScaler, Adam at `lr`: its loss
    falls close to 0, and the empty document at step 61 makes NaN gradients."""
    return write(
        tmp_path,
        name,
        model="tests.helpers.replay_runs:build_classifier",
        data="tests.helpers.replay_runs:build_documents",
        loss="tests.helpers.replay_runs:cross_entropy",
        optimizer={"name": "Adam", "lr": lr},
        precision={"dtype": "float16", "grad_scaler": True, "autocast_policy": "native"},
        steps=80,
    )


def plain(path: Path) -> Report:
    return diagnose(load_config(path), DiagnoseOptions(verify=False))


def test_a_smaller_rate_that_got_past_the_nan_only_because_the_scaler_skipped_it_is_refuted(
    tmp_path,
):
    """The sqrt of an empty document's zero vector has an infinite derivative: NaN
    gradients at step 61, at any learning rate. A replay with a 10x smaller rate skipped
    that step as the scaler does, and was called verified ("62/62 steps stayed finite past
    the failing step 61"); a plain run of that config fails at step 61 all the same."""
    report = diagnose(load_config(documents(tmp_path, lr=0.1)))
    first = report.first_nonfinite
    assert (first.step, first.phase) == (replay_runs.EMPTY_AT, "backward")
    lr = next(c for c in report.causes if c.id == "learning-rate-too-high")
    fixed = plain(documents(tmp_path, lr=0.01, name="fixed"))
    assert fixed.status == "nonfinite"
    assert fixed.first_nonfinite.step == replay_runs.EMPTY_AT  # what the verdict must agree with
    assert lr.verified is False
    assert f"the scaler hid the same NaN at step {replay_runs.EMPTY_AT}" in lr.verification
    assert report.causes[0].id == "nondifferentiable-point" and report.causes[0].verified


def test_a_baseline_of_a_run_whose_scaler_hides_a_nan_is_not_written(tmp_path):
    """`baseline` judges its run as `diagnose` does: the skip at the empty document is
    rechecked at loss scale 1, and a run that failed there is no baseline."""
    out = tmp_path / "baseline.json"
    path = documents(tmp_path, lr=0.01)
    result = CliRunner().invoke(app, ["baseline", str(path), "--out", str(out), "-q"])
    assert result.exit_code == 1, result.output
    assert "no baseline written: the run was not healthy" in result.output
    assert not out.exists()
