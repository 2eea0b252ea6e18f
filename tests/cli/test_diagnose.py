"""`nandoctor diagnose` as a user and a CI job see it: exit codes, one-line errors, JSON."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from tests.helpers.paths import CONFIGS
from tests.helpers.project import TRAIN_PY, base_config

runner = CliRunner()

SPEC_KEYS = {
    "schema_version", "tool", "command", "config", "environment", "status", "steps_completed",
    "first_nonfinite", "causes", "transients", "forecast", "events", "telemetry",
}  # fmt: skip
FIRST_NONFINITE_KEYS = {
    "step", "phase", "module", "op", "tensor", "value", "dtype", "shape", "count_nonfinite",
    "source", "reproduced", "frames", "micro_batch", "samples",
}  # fmt: skip


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_seed_example_exits_1_with_the_step_and_phase():
    result = invoke("diagnose", str(CONFIGS / "seed-fp16-nan.yaml"), "--quiet", "--no-verify")
    assert result.exit_code == 1
    assert "NONFINITE" in result.output and "phase loss" in result.output


def test_fixed_example_exits_0():
    result = invoke("diagnose", str(CONFIGS / "seed-fixed.yaml"), "--quiet", "--steps", "50")
    assert result.exit_code == 0, result.output
    assert "HEALTHY" in result.output and "all 50 steps stayed finite" in result.output


def test_json_to_stdout_holds_the_spec_fields():
    result = invoke(
        "diagnose", str(CONFIGS / "seed-fp16-nan.yaml"), "--json", "-", "-q", "--no-verify"
    )
    report = json.loads(result.stdout)
    assert set(report) >= SPEC_KEYS
    assert report["schema_version"] == 2 and report["command"] == "diagnose"
    assert set(report["environment"]) == {
        *("device", "torch", "dtype", "grad_scaler", "threads"),
        *("autocast_policy", "data_sharding"),
    }
    assert report["environment"]["autocast_policy"] == "native"  # the seed config pins it
    assert set(report["first_nonfinite"]) == FIRST_NONFINITE_KEYS
    assert report["status"] == "nonfinite"
    assert report["first_nonfinite"]["step"] == report["steps_completed"] > 0
    assert set(report["telemetry"]) == {"step", "loss", "grad_norm", "scale"}
    assert report["telemetry"]["loss"][-1] == "nan"  # JSON has no NaN literal
    # its GradScaler's skips, and the forecasts that saw the failure coming
    assert {e["kind"] for e in report["events"]} == {"scaler-skip", "forecast"}
    forecast_keys = {e["cause"] for e in report["events"] if e["kind"] == "forecast"}
    assert forecast_keys == {f["kind"] for f in report["forecast"]} >= {"log-of-softmax"}


def test_json_file_is_written(tmp_path):
    out = tmp_path / "report.json"
    result = invoke(
        "diagnose", str(CONFIGS / "seed-fixed.yaml"), "--steps", "5", "-q", "--json", str(out)
    )
    assert result.exit_code == 0
    assert json.loads(out.read_text())["status"] == "healthy"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temp file left


def test_config_error_is_one_line_exit_2_no_traceback(project):
    path = project({**base_config(), "stepz": 3})
    result = invoke("diagnose", str(path))
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert f"error: {path}:10: unknown key 'stepz'; did you mean 'steps'?" in result.output


def test_user_code_raising_is_exit_3_and_shows_the_users_frame(project):
    result = invoke("diagnose", str(project(base_config(model="train.py:raises"))))
    assert result.exit_code == 3
    assert "train.py" in result.output and "raise RuntimeError" in result.output
    assert (
        "error: model train.py:raises raised RuntimeError: the user's builder broke"
        in result.output
    )


def test_report_path_in_a_missing_folder_fails_before_running(tmp_path):
    result = invoke(
        "diagnose", str(CONFIGS / "seed-fixed.yaml"), "--json", str(tmp_path / "no" / "r.json")
    )
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_bad_dtype_option_is_a_usage_error():
    result = invoke("diagnose", str(CONFIGS / "seed-fixed.yaml"), "--dtype", "fp8")
    assert result.exit_code == 2
    assert "unknown dtype 'fp8'" in result.output


def test_options_override_the_config(project):
    path = project(base_config(data_args={"nan_at": 3}))
    result = invoke("diagnose", str(path), "--steps", "2", "--json", "-", "-q")
    assert result.exit_code == 0  # the NaN batch is at step 3, beyond 2 steps
    assert json.loads(result.stdout)["steps_completed"] == 2


def test_python_dash_m_works():
    out = subprocess.run(
        [sys.executable, "-m", "nandoctor", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith("nandoctor ")


def test_no_colour_codes_when_stdout_is_not_a_terminal():
    config = str(CONFIGS / "seed-fixed.yaml")
    out = subprocess.run(
        [sys.executable, "-m", "nandoctor", "diagnose", config, "--steps", "3"],
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "TERM": "xterm-256color"},
    )
    assert out.returncode == 0, out.stderr
    assert "HEALTHY" in out.stdout and "\x1b[" not in out.stdout + out.stderr


def test_sigterm_stops_the_run_writes_a_partial_report_and_exits_130(project, tmp_path):
    import signal
    import time

    started = tmp_path / "stepping"
    code = (
        TRAIN_PY
        + f"""

CALLS = [0]


def loss(model, batch):  # marks the run's third step, so the signal lands mid-run
    import pathlib
    CALLS[0] += 1
    if CALLS[0] == 3:
        pathlib.Path({str(started)!r}).touch()
    x, y = batch
    return F.cross_entropy(model(x), y)
"""
    )
    path = project(base_config(steps=10_000_000, loss="train.py:loss"), code)
    out = tmp_path / "report.json"
    command = [sys.executable, "-m", "nandoctor", "diagnose", str(path), "--json", str(out), "-q"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.perf_counter() + 120  # a loaded machine imports torch slowly
    while not started.exists() and time.perf_counter() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # NB: at its third step: some steps done
    proc.wait(timeout=60)  # NB: a bound for a hang, not a timing: it stops at the step's end
    assert proc.returncode == 130, proc.stderr.read()
    report = json.loads(out.read_text())
    assert report["status"] == "interrupted" and report["steps_completed"] > 0


def test_autocast_policy_on_the_command_line_overrides_the_config(project, tmp_path):
    config = project(base_config(precision={"dtype": "bfloat16", "autocast_policy": "native"}))
    out = tmp_path / "r.json"
    args = ["--steps", "2", "--quiet", "--json", str(out)]
    assert invoke("diagnose", str(config), *args).exit_code == 0
    assert json.loads(out.read_text())["environment"]["autocast_policy"] == "native"
    result = invoke("diagnose", str(config), "--autocast-policy", "cuda", *args)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["environment"]["autocast_policy"] == "cuda"


def test_an_unknown_autocast_policy_is_a_usage_error(project):
    result = invoke("diagnose", str(project(base_config())), "--autocast-policy", "tpu")
    assert result.exit_code == 2 and "expected cuda or native" in result.output


def test_a_dead_rank_is_named_before_the_peer_that_gloo_aborted_after_it():
    """Rank 1 was killed; rank 0 ended with its own error, and gloo aborted it on the way
    out: the launcher names rank 1. Deaths of the same kind name the lowest rank."""
    from nandoctor.cli.diagnose import first_death

    assert first_death({0: signal.SIGABRT, 1: signal.SIGKILL}) == (1, signal.SIGKILL)
    assert first_death({0: signal.SIGSEGV, 1: signal.SIGKILL}) == (0, signal.SIGSEGV)
    assert first_death({2: signal.SIGABRT, 1: signal.SIGABRT}) == (1, signal.SIGABRT)


def test_a_report_to_dev_stdout_reaches_a_pipe():
    """/dev/stdout on a pipe resolves to /proc/self/fd/pipe:[N], a name nothing opens:
    the report is written through the link, not beside its target."""
    config = str(CONFIGS / "seed-fixed.yaml")
    args = ["diagnose", config, "--steps", "2", "-q", "--json", "/dev/stdout"]
    out = subprocess.run(
        [sys.executable, "-m", "nandoctor", *args],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert '"status": "healthy"' in out.stdout


def test_a_time_budget_for_a_distributed_run_is_refused_before_any_rank_starts():
    """Ranks stopped by their own clocks would stop at different steps; refused once, by
    the command, not by each rank after the launch ('rank 1: ...')."""
    config = str(CONFIGS / "seed-fixed.yaml")
    result = invoke("diagnose", config, "--nproc-per-node", "2", "--time-budget", "5")
    assert result.exit_code == 2
    assert "error: --time-budget is not supported in distributed runs yet" in result.output
    assert "rank" not in result.output


def test_the_run_keeps_the_memory_its_steps_free_for_the_next(project, monkeypatch):
    # diagnose and baseline run the loop in this process: glibc's thresholds are set first
    # (tests/runtime/test_host_memory.py: what they change)
    from nandoctor.runtime import host_memory

    calls = []
    monkeypatch.setattr(host_memory, "keep_freed_memory", lambda: calls.append(1) or True)
    result = invoke("diagnose", str(project(base_config())), "--steps", "2", "-q")
    assert result.exit_code == 0, result.output
    assert calls == [1]


@pytest.mark.slow
def test_a_replay_of_more_than_10000_steps_from_step_0_says_to_start_from_a_checkpoint(
    project, tmp_path, monkeypatch
):
    """The rule at a threshold of 20 steps (10,001 real steps took minutes of a loaded CI)."""
    from nandoctor.diagnose import summary

    assert summary.LONG_REPLAY == 10_000  # as docs/index.md and troubleshooting.md say
    monkeypatch.setattr(summary, "LONG_REPLAY", 20)
    out = tmp_path / "report.json"
    at_the_limit = invoke("diagnose", str(project(base_config(steps=20))), "--json", str(out))
    assert at_the_limit.exit_code == 0, at_the_limit.output
    assert not [n for n in json.loads(out.read_text())["notes"] if "from step 0" in n]
    result = invoke("diagnose", str(project(base_config(steps=21))), "--json", str(out))
    assert result.exit_code == 0, result.output
    (note,) = [n for n in json.loads(out.read_text())["notes"] if "from step 0" in n]
    assert note.startswith("replayed 21 steps from step 0 to get here")
    assert "replayed 21 steps from step 0" in " ".join(result.output.split())  # the panel too
