"""`nandoctor watch -- CMD...` as users run it: a plain script, unchanged, in a subprocess
with the sentinel attached; exit 1 at the first bad step, the script's own code otherwise.

The subprocesses run this interpreter (`sys.executable`), as `python` would in a venv.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import nandoctor.cli.watch  # noqa: F401  (registers the command until cli/__init__ imports it)
from nandoctor.cli import app
from tests.helpers.paths import CONFIGS
from tests.scripts import seed_fp16_nan as seed
from tests.scripts.expected import SCRIPTS, SEED_SCRIPT, line_of, seed_diagnosis

PY = sys.executable


def watch(tmp_path: Path, *command: str, options: tuple[str, ...] = ()) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["watch", "--json", str(out), *options, "--", *command])
    assert out.exists(), result.output
    return result.exit_code, json.loads(out.read_text())


def test_the_seed_script_mirrors_its_config():
    config = yaml.safe_load((CONFIGS / "seed-fp16-nan.yaml").read_text())
    assert config["model_args"] == seed.MODEL_ARGS and config["data_args"] == seed.DATA_ARGS
    assert config["optimizer"] == {"name": "SGD", "lr": seed.LR, "momentum": seed.MOMENTUM}
    assert config["precision"] == {
        "dtype": "float16",
        "grad_scaler": True,
        "init_scale": seed.INIT_SCALE,
        "autocast_policy": "native",  # the script autocasts on the CPU, with the CPU's lists
    }
    assert (config["seed"], config["steps"], config["clip_grad_norm"]) == (
        seed.SEED,
        seed.STEPS,
        None,
    )
    assert config["loss"] == "nandoctor.examples.seed:handwritten_loss"  # the script's own loss


def test_the_seed_script_fails_under_watch_where_diagnose_says(tmp_path):
    code, report = watch(tmp_path, PY, str(SEED_SCRIPT))
    expected = seed_diagnosis()
    first, want = report["first_nonfinite"], expected["first_nonfinite"]
    assert code == 1 and report["status"] == "nonfinite" and report["command"] == "watch"
    assert (first["step"], first["phase"]) == (want["step"], want["phase"])
    assert (first["op"], first["tensor"], first["reproduced"]) == (want["op"], "output", "exact")
    assert first["source"].endswith(f"seed_fp16_nan.py:{line_of(SEED_SCRIPT, 'torch.log(')}")
    assert [c["id"] for c in report["causes"]] == [c["id"] for c in expected["causes"]]
    # the same skips, but watch cannot rerun a skip at loss scale 1: unchecked; and the
    # same forecasts, fired at the same steps
    skips = [e for e in expected["events"] if e["kind"] == "scaler-skip"]
    assert [{**e, "reason": "unchecked"} for e in skips] == [
        e for e in report["events"] if e["kind"] == "scaler-skip"
    ]
    assert {e["reason"] for e in skips} == {"overflow"}
    assert [e for e in expected["events"] if e["kind"] == "forecast"] == [
        e for e in report["events"] if e["kind"] == "forecast"
    ]
    assert report["forecast"] == expected["forecast"] != []
    assert report["steps_completed"] == expected["steps_completed"]
    assert report["environment"]["dtype"] == "float16" and report["environment"]["grad_scaler"]


def test_a_forecast_is_one_line_the_moment_it_fires_and_fails_the_command_if_asked(tmp_path, capfd):
    """The seed script stopped 10 steps before its failure: every step finite, yet its
    softmax is seen heading for float16's underflow."""
    options = ("--fail-on-forecast", "--no-replay")
    code, report = watch(tmp_path, PY, str(SEED_SCRIPT), "16", options=options)
    err = capfd.readouterr().err
    assert code == 1 and report["status"] == "healthy"
    (forecast,) = [f for f in report["forecast"] if f["kind"] == "log-of-softmax"]
    line = f"nandoctor watch: forecast at step {forecast['step']}: log-of-softmax in about "
    assert err.count(line) == 1 and "; fix: Use `F.cross_entropy(logits, target)`" in err


@pytest.mark.parametrize(("exit_code", "status"), [(0, "healthy"), (7, "error")])
def test_a_healthy_script_passes_with_its_own_exit_code(tmp_path, exit_code, status):
    code, report = watch(tmp_path, PY, str(SCRIPTS / "healthy.py"), str(exit_code), "5")
    assert code == exit_code
    assert report["status"] == status and report["first_nonfinite"] is None
    assert report["steps_completed"] == 5  # optimizer steps; the no_grad evaluation is not one
    assert report["environment"]["dtype"] == "float32"


def test_continue_lets_the_script_finish_and_still_exits_1(tmp_path, capfd):
    script = str(SCRIPTS / "nan_input.py")
    code, report = watch(tmp_path, PY, script, "3", "6", options=("--continue", "--no-replay"))
    assert code == 1 and "trained 6 steps" in capfd.readouterr().out
    first = report["first_nonfinite"]
    assert (first["step"], first["phase"], first["reproduced"]) == (3, "input", None)
    # NB: no replay, yet the batch tensor is named: the watched process described it
    assert (first["tensor"], first["value"], first["count_nonfinite"]) == ("input:0", "nan", 1)
    assert first["samples"] == [{"row": 0, "index": None, "nonfinite": 1}]
    assert report["causes"][0]["id"] == "nonfinite-input"


def test_after_continue_the_command_is_not_rerun_over_its_finished_files(tmp_path, capfd):
    """A rerun repeats the script's side effects: after --continue it would write the
    bad step's checkpoint over the one the finished run saved."""
    script = str(SCRIPTS / "nan_input.py")
    code, report = watch(tmp_path, PY, script, "3", "6", options=("--continue",))
    assert code == 1 and capfd.readouterr().out.count("trained 6 steps") == 1
    assert report["first_nonfinite"]["reproduced"] is None  # not replayed
    assert report["notes"][0].startswith("no replay after --continue: a rerun would repeat")


@pytest.mark.parametrize("nan_at", [0, 3])  # the model met in that call, or known before
def test_a_nan_in_keyword_labels_is_the_input_phase_and_named(tmp_path, nan_at):
    code, report = watch(tmp_path, PY, str(SCRIPTS / "keyword_labels.py"), str(nan_at), "6")
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"]) == (nan_at, "input")
    tensor = (first["tensor"], first["value"], first["reproduced"])
    assert tensor == ("input:labels", "nan", "exact")
    assert first["samples"] == [{"row": 3, "index": None, "nonfinite": 1}]
    assert report["causes"][0]["id"] == "nonfinite-input"


def test_python_dash_m_is_watched_too(tmp_path, capfd):
    code, report = watch(
        tmp_path, PY, "-m", "tests.scripts.nan_input", "2", "6", options=("--no-replay",)
    )
    assert code == 1 and "trained" not in capfd.readouterr().out  # stopped at the bad step
    assert (report["first_nonfinite"]["step"], report["first_nonfinite"]["phase"]) == (2, "input")


def test_arguments_reach_the_command_verbatim_never_through_a_shell(tmp_path, capfd):
    odd = "$(touch pwned); rm -rf * `x` 'q' \"dq\" --lr 3"
    print_args = "import sys; print(repr(sys.argv[1:]))"
    code, _ = watch(tmp_path, PY, "-c", print_args, odd, "--json", "x")
    assert code == 0 and repr([odd, "--json", "x"]) in capfd.readouterr().out
    assert not (Path.cwd() / "pwned").exists()


def test_a_command_that_never_imports_torch_keeps_its_exit_code(tmp_path):
    # NB: the bootstrap itself must not import torch (nor make `import nandoctor` do it)
    no_torch = "import sys; assert 'torch' not in sys.modules; raise SystemExit(4)"
    code, report = watch(tmp_path, PY, "-c", no_torch)
    assert code == 4 and report["status"] == "error" and report["steps_completed"] == 0
    assert any("not attached" in note for note in report["notes"])
    # not "all 0 steps stayed finite", under an ERROR
    assert report["summary"] == "the command exited with code 4 before any step was seen"


def test_a_command_that_trains_nothing_says_that_nothing_was_checked(tmp_path):
    # `-q` shows no notes: the summary says it (a CI gate read a green "0 steps finite")
    code, report = watch(tmp_path, PY, "-c", "pass")
    assert code == 0 and report["status"] == "healthy"
    assert report["summary"] == "no training step was seen, so nothing was checked"


def test_a_script_that_raises_exits_3_not_1_which_means_non_finite(tmp_path):
    """Python exits 1 on an uncaught exception, which read as "non-finite found" to a CI
    gate; raised before torch was imported (no sentinel yet) as after."""
    code, report = watch(tmp_path, PY, "-c", "raise ValueError('no such data folder')")
    assert code == 3 and report["status"] == "error"
    assert "it raised ValueError: no such data folder" in report["notes"][-1]
    code, report = watch(tmp_path, PY, "-c", "import sys; sys.exit(1)")
    assert code == 1 and report["status"] == "error"  # its own code, chosen: passed through


def test_a_users_own_sitecustomize_still_runs(tmp_path, capfd, monkeypatch):
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import builtins; builtins.THEIRS = 42\n")
    monkeypatch.setenv("PYTHONPATH", str(theirs))
    code, _ = watch(tmp_path, PY, "-c", "print('theirs', THEIRS)")
    assert code == 0 and "theirs 42" in capfd.readouterr().out


def test_usage_errors_exit_2_with_one_line():
    runner = CliRunner()
    assert runner.invoke(app, ["watch"]).exit_code == 2
    missing = runner.invoke(app, ["watch", "--", "no-such-command-for-nandoctor"])
    assert missing.exit_code == 2 and "cannot run 'no-such-command-for-nandoctor'" in missing.output
    typo = runner.invoke(app, ["watch", "--jsn", "r.json", "--", PY, "train.py"])
    assert typo.exit_code == 2 and "no such option: --jsn" in typo.output  # not run as a command


def test_a_script_that_is_not_there_is_not_blamed_on_the_install(tmp_path):
    code, report = watch(tmp_path, PY, str(tmp_path / "no_such_train.py"))
    assert code == 2 and report["status"] == "error"  # Python's own code, passed through
    assert "the command ended before any process of it imported torch" in report["notes"][0]
    assert not any("installed" in note for note in report["notes"])


def test_a_rerun_that_fails_elsewhere_keeps_the_first_verdict_and_says_why(tmp_path):
    state = tmp_path / "state"
    code, report = watch(tmp_path, PY, str(SCRIPTS / "unseeded.py"), str(state))
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"], first["reproduced"]) == (3, "input", None)
    assert any("not deterministic" in note for note in report["notes"])


def test_tensorboard_junit_and_fail_on_divergence_are_watch_options_too(tmp_path):
    """watch is a CI gate as diagnose is: the same reports for the same test reporters."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir, junit = tmp_path / "tb", tmp_path / "r.xml"
    script = str(SCRIPTS / "healthy.py")
    options = ("--tensorboard", str(logdir), "--fail-on-divergence", "--junit", str(junit))
    code, report = watch(tmp_path, PY, script, "0", "5", options=options)
    assert code == 0 and report["status"] == "healthy"  # no divergence in a healthy run
    cases = ET.fromstring(junit.read_text()).find("testsuite").findall("testcase")
    assert [c.get("name") for c in cases] == ["finite run", "no divergence"]
    assert not any(c.find("failure") is not None for c in cases)
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    assert [e.step for e in acc.Scalars("nandoctor/loss")] == [0, 1, 2, 3, 4]


def test_a_second_root_module_takes_the_models_outputs_not_the_batch(tmp_path):
    """`head(backbone(x))` with both met by the hooks: the head's arguments are the
    backbone's output, so a backbone that overflows is a forward failure, never input."""
    code, report = watch(tmp_path, PY, str(SCRIPTS / "two_roots.py"), "3", "6")
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"]) == (3, "forward")
    assert (first["op"], first["reproduced"]) == ("aten.mul.Tensor", "exact")
    assert "nonfinite-input" not in [c["id"] for c in report["causes"]]


@pytest.mark.parametrize(
    ("which", "order", "module", "phase", "op"),
    [
        ("G", "d-first", "radius", "backward", "aten.div.Tensor"),  # G's part, after D's step
        ("D", "g-first", "energy", "forward", "aten.log.default"),  # D's part, after G's step
        ("D", "d-first", "energy", "forward", "aten.log.default"),  # D, called after G(z)
    ],
)
def test_a_gan_fails_at_its_iteration_in_the_model_the_nan_began_in(
    tmp_path, which, order, module, phase, op
):
    """A GAN's loop, two models and two AdamW, bfloat16 autocast: the data of iteration 3
    breaks G (its backward) or D (its forward). One iteration is one step, whichever
    optimizer steps first, and the module is the path inside the model that broke."""
    command = (PY, str(SCRIPTS / "gan_nan.py"), which, "3", "6", order)
    code, report = watch(tmp_path, *command)
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"]) == (3, phase)
    assert (first["module"], first["op"], first["reproduced"]) == (module, op, "exact")
    assert report["steps_completed"] == 3


def test_under_torchrun_the_rank_whose_batch_went_nan_is_the_report(tmp_path):
    """Rank 1's batch holds a NaN at step 4: rank 1 fails in `input`, rank 0, which the
    all-reduce handed it to, in `backward`. The report is the origin's, whatever the
    processes' order."""
    torchrun = Path(sys.executable).parent / "torchrun"
    script = str(SCRIPTS / "ddp_nan_rank1.py")
    command = (str(torchrun), "--standalone", "--nproc-per-node", "2", script, "4", "8")
    code, report = watch(tmp_path, *command, options=("--no-replay",))
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"]) == (4, "input")
    # without a replay: rank 0 failed in the backward of the step rank 1's batch broke
    assert [(r["rank"], r["status"]) for r in report["ranks"]] == [(0, "inherited"), (1, "origin")]


def test_under_torchrun_the_replay_reads_the_origin_ranks_trace(tmp_path):
    """The rerun writes a trace per process: the launcher's (it imports torch, never
    steps), rank 0's (the NaN the all-reduce handed it, in `backward`) and rank 1's (its
    batch): the report is rank 1's, at the tensor, reproduced."""
    torchrun = Path(sys.executable).parent / "torchrun"
    script = str(SCRIPTS / "ddp_nan_rank1.py")
    command = (str(torchrun), "--standalone", "--nproc-per-node", "2", script, "4", "8")
    code, report = watch(tmp_path, *command)
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"], first["tensor"]) == (4, "input", "input:0")
    assert first["reproduced"] == "exact"
    assert [(r["rank"], r["status"]) for r in report["ranks"]] == [(0, "inherited"), (1, "origin")]
    assert (
        "born on rank 1 (rank 0 inherited it as the gradients were combined)" in (report["summary"])
    )
    # the launcher reports the ranks nandoctor stopped as a crash, before the report
    assert report["notes"] == [
        "nandoctor stopped the job at step 4, where it went non-finite on rank 1: the "
        "launcher's errors printed before this report (a peer's closed connection, "
        "ChildFailedError, a rank's exit code 1) follow from that stop, not from a crash"
    ]


def test_under_torchrun_a_nan_born_in_one_ranks_backward_is_that_ranks(tmp_path):
    """Rank 1's own backward makes the NaN at step 4 (its loss is finite): every rank
    fails in the backward, rank 0 in the copy of what the all-reduce handed it. The
    replay tells them apart: the report is rank 1's op, its cause named."""
    torchrun = Path(sys.executable).parent / "torchrun"
    script = str(SCRIPTS / "ddp_nan_rank1.py")
    command = (str(torchrun), "--standalone", "--nproc-per-node", "2", script, "4", "8")
    code, report = watch(tmp_path, *command, "backward")
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"]) == (4, "backward")
    assert (first["op"], first["reproduced"]) == ("aten.div.Tensor", "exact")
    assert "SqrtBackward0" in report["summary"] and "born on rank 1" in report["summary"]
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert (ranks[0]["status"], ranks[0]["first_nonfinite"]["op"]) == (
        "inherited",
        "aten.copy_.default",
    )
    assert ranks[1]["status"] == "origin"
    assert report["causes"][0]["id"] == "nondifferentiable-point"


WAITS_FOR_CTRL_C = """
import sys, time, torch
from pathlib import Path
torch.manual_seed(0)
wait_at = int(sys.argv[1])
first = Path("first-run")
rerun = first.exists()  # the first run leaves it: this is the replay
first.touch()
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(40):
    x = torch.randn(4, 8)
    if step == 20:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == wait_at and rerun == (wait_at < 20):
        Path("waiting").touch()  # the test's cue
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until the Ctrl-C comes
            time.sleep(0.05)
"""


def ctrl_c(tmp_path, *options: str, wait_at: int) -> tuple[int, str, dict]:
    """`watch` on WAITS_FOR_CTRL_C in a process group of its own, as a terminal's job;
    the whole group gets a Ctrl-C (SIGINT) once the script waits at step `wait_at`: in
    the rerun before step 20 (where the first run went NaN), after it in the first run.
    NB: the script waits on the test, not the test on a time the script should take."""
    import os
    import signal
    import subprocess
    import time

    (tmp_path / "train.py").write_text(WAITS_FOR_CTRL_C)
    out = tmp_path / "r.json"
    command = [PY, "-m", "nandoctor", "watch", "--json", str(out), *options, "--", PY, "train.py"]
    proc = subprocess.Popen(
        [*command, str(wait_at)],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300  # a loaded machine imports torch slowly
    while not (tmp_path / "waiting").exists() and proc.poll() is None:
        assert time.monotonic() < deadline, "the script never reached its wait"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, output = proc.communicate(timeout=120)
    return proc.returncode, output, json.loads(out.read_text())


def test_a_ctrl_c_during_the_replay_is_an_interrupt_not_a_rerun_that_ended_early(tmp_path):
    """Ctrl-C reaches the terminal's whole process group while the command is rerun: the
    report keeps the step the first run found and says the replay was interrupted (130),
    as `diagnose` does; it is not the rerun's fault."""
    code, output, report = ctrl_c(tmp_path, wait_at=10)
    assert code == 130 and "rerunning the command" in output
    assert report["status"] == "interrupted"
    assert (report["first_nonfinite"]["step"], report["first_nonfinite"]["phase"]) == (20, "input")
    assert report["notes"] == [
        "interrupted during the instrumented replay: where and why are unknown"
    ]


def test_a_ctrl_c_after_the_failure_starts_no_replay(tmp_path):
    """With --continue the script goes on past its bad step; a Ctrl-C then ends the watch
    with the failure as found, and the command is not run again behind the user's back."""
    code, output, report = ctrl_c(tmp_path, "--continue", wait_at=25)
    assert code == 1 and report["status"] == "nonfinite"  # what it found, as without Ctrl-C
    assert "step 20 went non-finite" in output and "rerunning the command" not in output
    assert report["first_nonfinite"]["step"] == 20
    assert report["notes"][0].startswith("no replay: the command was interrupted")


RAISES_ON_NAN = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Sigmoid())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
bce = nn.BCELoss()
data = torch.randn(6, 16, 4)
data[3, 5, 2] = float("nan")  # a corrupt record in batch 3
for i in range(6):
    opt.zero_grad()
    loss = bce(model(data[i]).squeeze(1), torch.ones(16))  # raises on a NaN probability
    loss.backward()
    opt.step()
"""


def test_a_nan_that_makes_the_script_raise_inside_its_step_is_that_steps_failure(tmp_path):
    """`nn.BCELoss` raises on a NaN probability (CUDA: a device-side assert) before the
    step ends: the step is judged as far as it went, and its NaN batch is the failure,
    found again by the replay (it was 'error: all 3 steps stayed finite')."""
    (tmp_path / "train.py").write_text(RAISES_ON_NAN)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"))
    first = report["first_nonfinite"]
    assert code == 1 and report["status"] == "nonfinite"
    assert (first["step"], first["phase"], first["tensor"]) == (3, "input", "input:0")
    assert first["reproduced"] == "exact" and report["causes"][0]["id"] == "nonfinite-input"


HALF_UNDER_SCALER = """
import torch
from torch import nn

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).half()  # "saves memory"
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(3):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 8).half()).float().pow(2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11's")
def test_a_script_whose_grad_scaler_refuses_float16_parameters_is_told_why(tmp_path):
    """The script's own GradScaler raises: its code raised (3, its frame printed by
    Python), and the report says why and what to do, not only PyTorch's one line."""
    (tmp_path / "train.py").write_text(HALF_UNDER_SCALER)
    proc = subprocess.run(
        [PY, "-m", "nandoctor", "watch", "--json", "r.json", "--", PY, "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 3, proc.stderr
    assert 'train.py", line 13, in <module>' in proc.stderr  # the user's frame
    assert "nandoctor: the parameters this optimizer steps are float16" in proc.stderr
    note = json.loads((tmp_path / "r.json").read_text())["notes"][-1]
    assert note.startswith("the command exited with code 1: it raised ValueError: ")
    assert "a GradScaler needs float32 master weights" in note
    assert "keep the parameters in float32" in note


SLOWER_RERUN = """
import sys, time
from pathlib import Path
import torch, torch.nn as nn
torch.manual_seed(0)
marker = Path(sys.argv[1])
rerun = marker.exists()  # the first run leaves it: this is the replay
marker.touch()
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    if rerun:
        time.sleep(60)  # a shared resource the rerun waits for
    x = torch.randn(16, 4)
    if i == 2:
        x[0, 0] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_rerun_stopped_for_its_time_says_so_not_that_it_ended_early(tmp_path, monkeypatch):
    """A rerun is stopped when it takes far longer than the first run took to fail: the
    note says it was stopped, and after how long (it read 'ended before step 2')."""
    from nandoctor.watch import runner

    monkeypatch.setattr(runner, "RERUN_MIN_S", 1.0)
    monkeypatch.setattr(runner, "RERUN_SLACK_S", 2.0)
    (tmp_path / "train.py").write_text(SLOWER_RERUN)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"), str(tmp_path / "marker"))
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"], first["reproduced"]) == (2, "input", None)
    note = next(n for n in report["notes"] if "rerun" in n)
    assert note.startswith("the instrumented replay did not reach step 2: the rerun of the ")
    assert "command was stopped after " in note and "ended before" not in note
    assert note.endswith(
        "(a rerun may take 3x the first run's time to fail plus 2 s, and at least 1 s)"
    )


RAISES_A_BUG = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(6):
    loss = model(torch.randn(16, 4)).pow(2).mean()
    if i == 3:
        raise RuntimeError("disk full while logging")
    opt.zero_grad(); loss.backward(); opt.step()
"""


def test_a_step_the_script_raised_in_without_a_nan_is_not_a_step_run(tmp_path):
    """A bug that ends the script inside step 3 leaves steps 0-2 run, finite: step 3 is
    not counted, and its loss without a backward is not telemetry (it was: 4 steps, the
    last with a gradient norm of 0)."""
    (tmp_path / "train.py").write_text(RAISES_A_BUG)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"))
    assert code == 3 and report["status"] == "error"  # the user's code raised
    assert (
        "the command exited with code 1: it raised RuntimeError: disk full while logging"
        in (report["notes"])
    )
    assert report["steps_completed"] == 3
    assert report["summary"] == "the command exited with code 1 after 3 finite steps"
    assert report["telemetry"]["step"] == [0, 1, 2]
    assert all(g > 0 for g in report["telemetry"]["grad_norm"])


CLOSURE_LOOP = """
import sys
import torch, torch.nn as nn
torch.manual_seed(0)
bad, lr = int(sys.argv[1]), float(sys.argv[2])
X, Y = torch.randn(80, 16), torch.randint(0, 4, (80,))
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(net.parameters(), lr=lr)
for i in range(10):
    x, y = X[i * 8 : (i + 1) * 8], Y[i * 8 : (i + 1) * 8]
    def closure():
        opt.zero_grad()
        p = torch.softmax(net(x), -1) * (0 if i == bad else 1)
        loss = -(torch.log(p).gather(1, y[:, None])).mean()  # marker:closure-log
        loss.backward()
        return loss
    opt.step(closure)  # the step opens at the optimizer, before the forward
"""


def test_a_closure_loops_step_0_is_traced_and_its_update_measured(tmp_path):
    """`optimizer.step(closure)` (Lightning's automatic optimization) opens the step at
    the optimizer, before the model is known: the replay of step 0 found nothing ('the
    failure is nondeterministic or transient') and an update at step 0 that broke the
    weights went unmeasured (no cause). Both start at the model's first forward now."""
    (tmp_path / "train.py").write_text(CLOSURE_LOOP)
    lines = CLOSURE_LOOP.splitlines()
    line = 1 + next(i for i, text in enumerate(lines) if "marker:closure-log" in text)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"), "0", "0.1")
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"]) == (0, "loss")
    assert (first["op"], first["reproduced"]) == ("aten.log.default", "exact")
    assert first["source"].endswith(f"train.py:{line}") and report["notes"] == []
    assert report["causes"][0]["id"] == "log-of-zero"
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"), "-1", "1e37")
    assert code == 1 and report["first_nonfinite"]["step"] == 1
    assert report["evidence"]["update"]["step"] == 0
    assert "learning-rate-too-high" in [c["id"] for c in report["causes"]]


def test_a_lightning_run_failing_at_its_first_step_is_localised(tmp_path):
    """Lightning steps its optimizer with a closure: the same, under a real Trainer."""
    pytest.importorskip("lightning")
    (tmp_path / "train.py").write_text(LIGHTNING_LOG0)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"))
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"]) == (0, "loss")
    assert (first["op"], first["reproduced"]) == ("aten.log.default", "exact")
    assert report["causes"][0]["id"] == "log-of-zero"


LIGHTNING_LOG0 = """
import torch, torch.nn as nn
import lightning as L
L.seed_everything(0, verbose=False)
X, Y = torch.randn(80, 16), torch.randint(0, 4, (80,))
class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    def training_step(self, batch, i):
        x, y = batch
        p = torch.softmax(self.net(x), -1) * (0 if i == 0 else 1)
        return -(torch.log(p).gather(1, y[:, None])).mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
trainer = L.Trainer(accelerator="cpu", max_steps=5, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(M(), data)
"""


ACCELERATE_BF16 = """
import torch, torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
set_seed(0)
accelerator = Accelerator(mixed_precision="bf16", cpu=True)
X, Y = torch.randn(48, 16), torch.randint(0, 4, (48,))
X[5 * 8 + 3, 2] = float("nan")  # in batch 5
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=8)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, opt, data = accelerator.prepare(model, opt, data)
for x, y in data:
    loss = nn.functional.cross_entropy(model(x), y)
    accelerator.backward(loss)
    opt.step(); opt.zero_grad()
"""


def test_an_accelerate_run_in_bfloat16_is_reported_in_bfloat16(tmp_path):
    """accelerate enters autocast inside the model's forward: the run computes in
    bfloat16, and the report says so (it said float32)."""
    pytest.importorskip("accelerate")
    (tmp_path / "train.py").write_text(ACCELERATE_BF16)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"), options=("--no-replay",))
    assert code == 1 and report["first_nonfinite"]["step"] == 5
    assert report["environment"]["dtype"] == "bfloat16"


def test_the_command_starts_before_nandoctor_imports_torch():
    """What runs the command is free of torch: the command starts at once, and what reads
    its results (torch among it, ~2 s) is imported while it runs (it cost ~2.5 s before)."""
    import subprocess

    code = (
        "import sys, nandoctor.cli.watch, nandoctor.watch.process; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


ACCUMULATING = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(5, 2, 8, 4)  # 5 steps of 2 micro-batches
data[3, 1, 0, 0] = float("nan")  # step 3, micro-batch 1
for step in data:
    opt.zero_grad()
    for x in step:
        (model(x).pow(2).mean() / 2).backward()
    opt.step()
"""


def test_the_micro_batch_a_nan_came_in_is_named_under_gradient_accumulation(tmp_path):
    """Each loss begun after a backward, no optimizer step between, is the step's next
    micro-batch (as diagnose numbers its `grad_accum_steps`); it was null under watch."""
    (tmp_path / "train.py").write_text(ACCUMULATING)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"))
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"], first["tensor"]) == (3, "input", "input:0")
    assert first["micro_batch"] == 1


WARMUP_NAN = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
for i in range(8):
    x = torch.randn(16, 4)
    if i == 6:
        x[0, 0] = float("nan")
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step(); sched.step()
"""


def test_a_run_whose_scheduler_raised_the_rate_is_reported(tmp_path):
    """The facts a watched process sends back hold the rate's largest jump (a warmup's):
    it came back as a plain dict, and every failing run with a warmup crashed the report
    ("internal error: 'dict' object has no attribute 'factor'")."""
    (tmp_path / "train.py").write_text(WARMUP_NAN)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"))
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"]) == (6, "input")
    assert report["causes"][0]["id"] == "nonfinite-input"


CLIPS_BEFORE_UNSCALE = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for i in range(6):
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # still scaled: the bug
    scaler.step(opt)
    scaler.update()
"""


def test_a_healthy_loop_that_clips_before_unscale_is_told_so(tmp_path, capfd):
    """The brief's bug that breaks nothing: the run trains 65536x too slowly, and stays
    finite. The hooks see the clip meet scaled gradients: the report's note and a warning
    in the script's output say so (nothing else could: it was HEALTHY, no word)."""
    (tmp_path / "train.py").write_text(CLIPS_BEFORE_UNSCALE)
    code, report = watch(tmp_path, PY, str(tmp_path / "train.py"))
    assert code == 0 and report["status"] == "healthy"
    assert any(n.startswith("step 0 clipped the gradients before scaler.unscale_") for n in
               report["notes"])  # fmt: skip
    assert "clip-before-unscale" in capfd.readouterr().err


def test_a_nan_the_scaler_hides_at_scattered_steps_is_found_where_it_began(tmp_path):
    """A backward 0/0 at steps 4, 7, 10, ..., its loss finite: each is skipped, the clean
    steps between end every streak, so only the scale's fall to 1 fails the run, dozens of
    steps later. The skips are rechecked at loss scale 1 in a rerun: step 4 was no overflow."""
    script = str(SCRIPTS / "hidden_skips.py")
    code, report = watch(tmp_path, PY, script, "4", "3", "80", options=("--no-replay",))
    first = report["first_nonfinite"]
    assert code == 1 and first["step"] > 40  # unchecked: the collapse, long after
    assert {e["reason"] for e in report["events"] if e["kind"] == "scaler-skip"} == {"unchecked"}

    code, report = watch(tmp_path, PY, script, "4", "3", "80")
    first = report["first_nonfinite"]
    assert code == 1 and (first["step"], first["phase"], first["op"]) == (
        4,
        "backward",
        "aten.div.Tensor",
    )
    assert (
        "but its gradients are non-finite at loss scale 1 too (rechecked in a rerun"
        in (report["summary"])
    )
    assert "SqrtBackward0" in report["summary"]
    assert [c["id"] for c in report["causes"]][:1] == ["nondifferentiable-point"]
    assert "grad-scaler-collapse" not in [c["id"] for c in report["causes"]]
    assert report["steps_completed"] == 4 and report["telemetry"]["step"][-1] == 4


@pytest.mark.parametrize("mode", ["twoscaled", "retain"])
def test_the_recheck_sees_every_scaled_loss_and_keeps_a_graph_the_loop_backwards_again(
    tmp_path, mode
):
    """`(scale(a) + scale(b)).backward()`: the NaN in `a`, scaled first, was not rechecked
    (every skip read "overflow"); `scale(a).backward(retain_graph=True)` then
    `scale(b).backward()`: the recheck freed the graph, and the loop raised in the rerun."""
    script = str(SCRIPTS / "hidden_skips.py")
    code, report = watch(tmp_path, PY, script, "4", "3", "80", mode)
    assert code == 1 and report["first_nonfinite"]["step"] == 4
    assert "non-finite at loss scale 1 too (rechecked in a rerun" in report["summary"]


def test_a_rerun_that_skips_other_steps_leaves_the_skips_unchecked(tmp_path):
    """A script whose runs differ: the rerun's answers are not the first run's steps'."""
    script = str(SCRIPTS / "hidden_skips.py")
    state = str(tmp_path / "state")
    code, report = watch(tmp_path, PY, script, "4", "3", "80", "differs", state)
    assert code == 1 and report["first_nonfinite"]["step"] > 40  # the first run's collapse
    assert report["notes"][0] == (
        "the GradScaler's skips could not be rechecked at loss scale 1: the rerun of the "
        "command did not skip step 4, as the first run did, so the script is not "
        "deterministic: seed Python, numpy and torch, and fix its data order"
    )
    assert {e["reason"] for e in report["events"] if e["kind"] == "scaler-skip"} == {"unchecked"}
