"""`--tensorboard DIR`: event files TensorBoard reads back, with the run's telemetry."""

from __future__ import annotations

import sys

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from tests.helpers.project import base_config

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import (
    EventAccumulator,
)

runner = CliRunner()


def read_back(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(f"nandoctor/{tag}")]


def test_diagnose_writes_the_telemetry_and_the_failure(project, tmp_path):
    config = project(
        base_config(
            data_args={"nan_at": 3},
            precision={"dtype": "float16", "grad_scaler": True},
            steps=5,
        )
    )
    logdir = tmp_path / "tb"
    result = runner.invoke(
        app, ["diagnose", str(config), "-q", "--no-verify", "--tensorboard", str(logdir)]
    )
    assert result.exit_code == 1, result.output
    acc = read_back(logdir)
    loss = scalars(acc, "loss")
    assert [step for step, _ in loss] == [0, 1, 2, 3]
    assert all(v > 0 for _, v in loss[:3])
    assert [s for s, _ in scalars(acc, "grad_norm")] == [0, 1, 2, 3]
    assert scalars(acc, "loss_scale")[0] == (0, 65536.0)
    tags = acc.Tags()
    assert "nandoctor/failure/text_summary" in tags["tensors"]
    (text,) = acc.Tensors("nandoctor/failure/text_summary")
    assert text.step == 3
    assert b"non-finite at step 3, phase input" in text.tensor_proto.string_val[0]


def test_compare_writes_one_run_per_dtype_with_module_peaks(project, tmp_path):
    config = project(base_config(steps=3))
    logdir = tmp_path / "tb"
    result = runner.invoke(
        app, ["compare", str(config), "--dtype", "bf16", "-q", "--tensorboard", str(logdir)]
    )
    assert result.exit_code == 0, result.output
    for dtype in ("float32", "bfloat16"):
        acc = read_back(logdir / dtype)
        assert [s for s, _ in scalars(acc, "loss")] == [0, 1, 2]
        assert any(t.startswith("nandoctor/max_abs/") for t in acc.Tags()["scalars"]), dtype


def test_without_tensorboard_it_is_one_line_before_the_run(project, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    config = project(base_config())
    result = runner.invoke(app, ["diagnose", str(config), "--tensorboard", str(tmp_path / "tb")])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[0] == (
        "error: --tensorboard needs the tensorboard package, which is not installed"
    )
    assert "pip install 'nandoctor[tensorboard]'" in result.stderr
    assert not (tmp_path / "tb").exists()


@pytest.mark.parametrize("command", ["diagnose", "compare"])
def test_a_file_where_the_folder_goes_is_one_line_before_the_run(project, tmp_path, command):
    """Refused before the run (which would otherwise run in full), naming the option; no
    report is left behind."""
    config = project(base_config(steps=3))
    (tmp_path / "tb").write_text("mine")
    result = runner.invoke(
        app,
        [
            command,
            str(config),
            "--tensorboard",
            str(tmp_path / "tb"),
            "--json",
            str(tmp_path / "r.json"),
        ],
    )
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[0] == (
        f"error: --tensorboard {tmp_path / 'tb'}: is a file, expected a folder"
    )
    assert "step" not in result.stdout  # no run
    assert (tmp_path / "tb").read_text() == "mine" and not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("command", ["diagnose", "compare", "watch"])
def test_a_report_at_the_folders_path_is_one_line_before_the_run(project, tmp_path, command):
    """`--json out --tensorboard out`: the writer would make the folder, and the report
    could not be written over it after the whole run."""
    config = project(base_config(steps=3))
    same = str(tmp_path / "out")
    run = ["--", sys.executable, "-c", "pass"] if command == "watch" else [str(config)]
    args = ["--tensorboard", same, "--json", same]
    result = runner.invoke(
        app, [command, *args, *run] if command == "watch" else [command, *run, *args]
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[0] == (
        f"error: --json and --tensorboard name the same path: {same}"
    )
    assert not (tmp_path / "out").exists()
