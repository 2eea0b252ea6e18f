"""Faults and odd-but-legal runs: every one ends with SPEC's exit code and one clear line,
never a traceback from nandoctor, never a hang, never a user's file overwritten, and the
report written where one was asked for (the style of the bad-input matrix: a case a row)."""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from unittest import mock

import pytest
import torch
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.cli import output as output_module
from nandoctor.cli.outcome import exit_code, of_baseline, of_comparison, of_report
from nandoctor.report.comparison import CompareEnvironment, CompareRun, Comparison
from nandoctor.report.types import Environment, Report
from nandoctor.runtime.snapshot import StateSnapshot
from tests.helpers.project import TRAIN_PY

runner = CliRunner()

FAULTS_PY = """
import os, sys, threading, time
import torch
import torch.nn.functional as F
from torch import nn
from train import build_data


def xy_loss(model, batch):
    x, y = batch
    x = x.to_dense()
    return F.cross_entropy(model(x if x.is_floating_point() else x.float()), y)


def dict_loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def calls_sys_exit(model, batch):
    sys.exit(4)


CALLS = []


def raises_at_step_two(model, batch):
    CALLS.append(1)
    if len(CALLS) == 3:
        raise RuntimeError("the user's loss broke")
    return xy_loss(model, batch)


def calls_os_exit(model, batch):
    os._exit(5)


def presses_ctrl_c(model, batch):
    raise KeyboardInterrupt


def ctrl_c_while_building():
    raise KeyboardInterrupt


def exits_while_building():
    raise SystemExit(0)


def needs_more_memory(model, batch):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")


def sets_float64(model, batch):
    torch.set_default_dtype(torch.float64)
    return xy_loss(model, batch)


def sets_one_thread(model, batch):
    torch.set_num_threads(1)
    return xy_loss(model, batch)


def prints(model, batch):
    print("a line the user printed")
    return xy_loss(model, batch)


def changes_directory(model, batch):
    os.makedirs("elsewhere", exist_ok=True)
    os.chdir("elsewhere")
    return xy_loss(model, batch)


def model64():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).double()


class Complex(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 3, dtype=torch.complex64))

    def forward(self, x):
        return (x.to(torch.complex64) @ self.w).abs()


def complex_model():
    return Complex()


def _with_nan(data):
    data[1][0][0, 0] = float("nan")
    return data


def data64(nan=False):
    data = [(x.double(), y) for x, y in build_data()]
    return _with_nan(data) if nan else data


def sparse(nan=False):
    data = build_data()
    data = _with_nan(data) if nan else data
    return [(x.to_sparse(), y) for x, y in data]


def ints():
    return [(torch.randint(0, 5, (8, 8)), torch.randint(0, 3, (8,))) for _ in range(4)]


def odd_fields(kind, nan=False):
    data = _with_nan(build_data()) if nan else build_data()
    field = {
        "meta": lambda: torch.empty(3, device="meta"),
        "lock": threading.Lock,
        "file": lambda: open(__file__),
    }[kind]
    return [{"x": x, "y": y, "extra": field()} for x, y in data]


def weighted(weights):
    # a weight per sample, exported from a spreadsheet into the config
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(len(weights), 8, generator=g), torch.randint(0, 3, (len(weights),), generator=g)
    sampler = torch.utils.data.WeightedRandomSampler(weights, num_samples=32, generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)


def half_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).half()


def float16_by_default():
    torch.set_default_dtype(torch.float16)  # "to save memory", in the builder
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


class GreedyUnderTrace(nn.Module):
    # needs room only while every op is checked (the tracer's dispatch mode): the replay
    # runs out of memory where the run did not
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x):
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        if _get_current_dispatch_mode_stack():
            torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the CPU's allocator refuses it
        return self.net(x)


def starts_a_thread(model, batch):
    if not getattr(starts_a_thread, "started", False):
        starts_a_thread.started = True
        threading.Thread(target=time.sleep, args=(3600,), name="user-sleeper").start()
    return xy_loss(model, batch)
"""

BASE = """\
model: train.py:build_model
data: train.py:build_data
optimizer: {name: SGD, lr: 0.1}
precision: {dtype: float32}
steps: 3
device: cpu
"""


@pytest.fixture
def folder(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text(TRAIN_PY)
    (tmp_path / "faults.py").write_text(textwrap.dedent(FAULTS_PY))
    monkeypatch.syspath_prepend(str(tmp_path))  # faults.py imports train.py
    monkeypatch.chdir(tmp_path)
    return tmp_path


def configured(folder, extra: str = "", base: str = BASE):
    lines = {line.split(":")[0]: line for line in base.splitlines()}
    for line in textwrap.dedent(extra).splitlines():
        lines[line.split(":")[0]] = line
    (folder / "config.yaml").write_text("\n".join(lines.values()) + "\n")
    return folder / "config.yaml"


def diagnose(*args: str):
    return runner.invoke(app, ["diagnose", *args, "-q"])


def no_traceback_of_ours(result) -> None:
    assert "Traceback (most recent call last)" not in result.output
    assert "nandoctor/" not in result.output.replace("nandoctor/examples", "")


# (name, config lines, exit code, fragment of the output, report status or None)
RUNS = [
    ("sys.exit in the loss", "loss: faults.py:calls_sys_exit", 3, "loss (step 0) called sys.exit(4): your code ended the run", "error"),
    ("os._exit in the loss", "loss: faults.py:calls_os_exit", 3, "loss (step 0) called os._exit(5)", "error"),
    # NB: the report of the steps before is written (a CI job's `if: always()` finds it)
    ("an exception in the loss", "loss: faults.py:raises_at_step_two", 3, "error: loss (step 2) raised RuntimeError: the user's loss broke", "error"),
    ("SystemExit in the model builder", "model: faults.py:exits_while_building", 3, "called sys.exit(0)", None),
    ("Ctrl-C in the loss", "loss: faults.py:presses_ctrl_c", 130, "INTERRUPTED", "interrupted"),
    ("Ctrl-C while building the model", "model: faults.py:ctrl_c_while_building", 130, "interrupted", "interrupted"),
    ("out of memory in the loss", "loss: faults.py:needs_more_memory", 2, "loss (step 0) ran out of memory: CUDA out of memory", None),
    ("float64 weights and batches", "model: faults.py:model64\ndata: faults.py:data64\nloss: faults.py:xy_loss", 0, "HEALTHY", "healthy"),
    ("float64 batch holding NaN", "model: faults.py:model64\ndata: faults.py:data64\ndata_args: {nan: true}\nloss: faults.py:xy_loss", 1, "input:0 held 1 NaN", "nonfinite"),
    ("complex weights", "model: faults.py:complex_model", 0, "HEALTHY", "healthy"),
    ("complex weights, NaN batch", "model: faults.py:complex_model\ndata_args: {nan_at: 1}", 1, "input:0 held 1 NaN", "nonfinite"),
    ("sparse batches", "data: faults.py:sparse\nloss: faults.py:xy_loss", 0, "HEALTHY", "healthy"),
    ("sparse batch holding NaN", "data: faults.py:sparse\ndata_args: {nan: true}\nloss: faults.py:xy_loss", 1, "input:0 held 1 NaN", "nonfinite"),
    ("integer-only batches", "data: faults.py:ints\nloss: faults.py:xy_loss", 0, "HEALTHY", "healthy"),
    ("a meta tensor in the batch", "data: faults.py:odd_fields\ndata_args: {kind: meta, nan: true}\nloss: faults.py:dict_loss", 1, "input:x held 1 NaN", "nonfinite"),
    ("a lock in the batch", "data: faults.py:odd_fields\ndata_args: {kind: lock, nan: true}\nloss: faults.py:dict_loss", 1, "input:x held 1 NaN", "nonfinite"),
    ("an open file in the batch", "data: faults.py:odd_fields\ndata_args: {kind: file}\nloss: faults.py:dict_loss", 0, "HEALTHY", "healthy"),
    ("set_default_dtype in the loss", "loss: faults.py:sets_float64", 0, "HEALTHY", "healthy"),
    ("set_num_threads in the loss", "loss: faults.py:sets_one_thread", 0, "HEALTHY", "healthy"),
    # a GradScaler cannot unscale float16 gradients (it was 'internal error: ValueError:
    # Attempting to unscale FP16 gradients.'): refused before the first step
    ("float16 parameters under the default GradScaler", "model: faults.py:half_model\nprecision: {dtype: float16}", 2, "config.yaml:4: precision.grad_scaler: the optimizer's parameters are float16 (4 of 4: 0.weight, 0.bias, 2.weight, ...), and a GradScaler (on by default with float16) needs float32 master weights", None),
    ("set_default_dtype(float16) in the builder, a GradScaler", "model: faults.py:float16_by_default\nprecision: {dtype: float16, grad_scaler: true}", 2, "precision.grad_scaler: the optimizer's parameters are float16 (4 of 4", None),
    ("float16 parameters, no GradScaler", "model: faults.py:half_model\nprecision: {dtype: float16, grad_scaler: false}", 0, "HEALTHY", "healthy"),
    # the CPU's allocator raises a RuntimeError (it was 'internal error: RuntimeError:
    # [enforce fail at alloc_cpu.cpp:127] ...'): the stage is named, the report written
    ("out of memory in the instrumented replay", "model: faults.py:GreedyUnderTrace\ndata_args: {nan_at: 2}", 2, "error: out of memory in the instrumented replay of step 2, in the full trace of step 2 and again in the lighter one: the report of what the run saw stands (step 2, phase input)", "nonfinite"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "extra", "code", "message", "status"), RUNS, ids=[r[0] for r in RUNS]
)
def test_each_odd_run_ends_with_its_exit_code_and_report(
    folder, name, extra, code, message, status
):
    dtype, threads, grad = (
        torch.get_default_dtype(),
        torch.get_num_threads(),
        torch.is_grad_enabled(),
    )
    out = folder / "report.json"
    result = diagnose(str(configured(folder, extra)), "--json", str(out), "--no-verify")
    assert result.exit_code == code, result.output
    assert message in result.output
    no_traceback_of_ours(result)
    if status is None:
        assert not out.exists()
    else:
        assert json.loads(out.read_text())["status"] == status
    # the user's global settings never leak into nandoctor's (or the next run's) work
    assert (torch.get_default_dtype(), torch.get_num_threads()) == (dtype, threads)
    assert torch.is_grad_enabled() == grad


def test_float16_parameters_under_a_grad_scaler_say_why_and_both_ways_out_in_one_line(folder):
    config = configured(folder, "model: faults.py:half_model\nprecision: {dtype: float16}")
    result = diagnose(str(config))
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "a GradScaler (on by default with float16) needs float32 master weights" in line
    assert "set precision.grad_scaler: false" in line
    assert "or keep the parameters in float32" in line and "let autocast cast them" in line
    assert "internal error" not in result.output


def test_out_of_memory_in_the_replay_says_how_to_give_it_room(folder):
    config = configured(folder, "model: faults.py:GreedyUnderTrace\ndata_args: {nan_at: 2}")
    result = diagnose(str(config), "--json", "report.json", "--no-verify")
    assert result.exit_code == 2, result.output
    assert "hint: the replay needs more memory than the run: give it room with a smaller " in (
        result.output
    )
    assert "fewer micro-batches in the step it traces (grad_accum_steps)" in result.output
    report = json.loads((folder / "report.json").read_text())
    assert report["first_nonfinite"]["reproduced"] is None
    assert report["notes"][-1].startswith(
        "the instrumented replay of step 2 ran out of memory in the full trace of step 2 and "
        "again in the lighter one: what the run saw stands"
    )


def test_a_global_setting_the_users_code_changed_is_reported(folder):
    result = diagnose(str(configured(folder, "loss: faults.py:sets_float64")), "--json", "r.json")
    assert result.exit_code == 0, result.output
    notes = json.loads((folder / "r.json").read_text())["notes"]
    assert any("your code set torch's default dtype to torch.float64" in n for n in notes)
    assert torch.get_default_dtype() == torch.float32


# (name, the --json path given, relative to the folder; what it is)
INPUTS = [
    ("a symlink to the checkpoint", "ckpt-link", "the run's checkpoint"),
    ("the config", "config.yaml", "the run's config"),
    ("a source file it names", "train.py", "the run's model source train.py"),
    ("the checkpoint", "start.pt", "the run's checkpoint"),
    ("a symlink to the config", "link.json", "the run's config"),
    # NB: refused before the run, which has not imported it yet: as any Python source
    ("an imported module's file", "faults.py", "a Python source file"),
]


@pytest.mark.parametrize(("name", "target", "what"), INPUTS, ids=[i[0] for i in INPUTS])
def test_a_report_never_overwrites_the_runs_own_files(folder, name, target, what):
    torch.save(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).state_dict(), folder / "start.pt")  # fmt: skip
    config = configured(folder, "checkpoint: start.pt\nloss: faults:xy_loss")  # by module
    (folder / "link.json").symlink_to(config)
    (folder / "ckpt-link").symlink_to(folder / "start.pt")
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    result = diagnose(str(config), "--json", target)
    assert result.exit_code == 2, result.output
    assert f"is {what}; refusing to overwrite it" in result.output
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before


def test_a_report_through_a_symlink_replaces_the_file_it_points_to(folder):
    (folder / "reports").mkdir()
    (folder / "reports" / "run1.json").write_text("old")
    (folder / "latest.json").symlink_to(folder / "reports" / "run1.json")
    assert diagnose(str(configured(folder)), "--json", "latest.json").exit_code == 0
    assert (folder / "latest.json").is_symlink()
    assert json.loads((folder / "reports" / "run1.json").read_text())["status"] == "healthy"


def test_two_reports_on_one_file_are_refused_before_the_run(folder):
    result = diagnose(str(configured(folder)), "--json", "r.json", "--markdown", "./r.json")
    assert result.exit_code == 2 and "--json and --markdown name the same file" in result.output
    assert not (folder / "r.json").exists()


def test_a_relative_report_path_is_where_the_command_started(folder):
    config = configured(folder, "loss: faults.py:changes_directory")
    result = diagnose(str(config), "--json", "report.json")
    assert result.exit_code == 0, result.output
    assert json.loads((folder / "report.json").read_text())["status"] == "healthy"
    assert not (folder / "elsewhere" / "report.json").exists()


def test_json_on_stdout_stays_parseable_when_the_users_code_prints(folder):
    result = diagnose(str(configured(folder, "loss: faults.py:prints")), "--json", "-")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["status"] == "healthy"
    assert "a line the user printed" in result.stderr


def test_a_full_disk_is_exit_2_not_non_finite_and_the_old_report_survives(folder, monkeypatch):
    out = folder / "report.json"
    out.write_text("the previous report")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_module.os, "fsync", full)
    result = diagnose(str(configured(folder)), "--json", str(out))
    assert result.exit_code == 2, result.output
    assert "--json" in result.output and "no space left on the device" in result.output
    no_traceback_of_ours(result)
    assert out.read_text() == "the previous report"
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temp file


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_device_that_is_full(folder):
    result = diagnose(str(configured(folder)), "--json", "/dev/full")
    assert result.exit_code == 2, result.output
    assert "--json /dev/full: cannot write the report: no space left" in result.output


def test_a_rename_across_devices_falls_back_to_a_copy(folder, monkeypatch):
    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(output_module.os, "replace", cross_device)
    result = diagnose(str(configured(folder)), "--json", "report.json")
    assert result.exit_code == 0, result.output
    assert json.loads((folder / "report.json").read_text())["status"] == "healthy"
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def test_a_new_report_is_readable_by_others_as_the_umask_says(folder):
    previous = os.umask(0o022)
    try:
        assert diagnose(str(configured(folder)), "--json", "report.json").exit_code == 0
    finally:
        os.umask(previous)
    assert (folder / "report.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (RuntimeError("something nandoctor did not foresee"), 2, "internal error: RuntimeError"),
        (PermissionError(errno.EACCES, "Permission denied", "/x/cache"), 2, "Permission denied: /x/cache"),
        (OSError(errno.ENOSPC, "No space left on device"), 2, "no space left on the device"),
        (MemoryError(), 2, "out of memory"),
        (torch.OutOfMemoryError("CUDA out of memory"), 2, "out of memory"),
    ],
    ids=["a bug", "a permission", "a full disk", "host memory", "device memory"],
)  # fmt: skip
def test_an_unforeseen_exception_is_one_line_and_never_exit_1(
    folder, monkeypatch, error, code, message
):
    from nandoctor.diagnose import engine

    monkeypatch.setattr(engine, "diagnose", mock.Mock(side_effect=error))  # raised in a library
    result = diagnose(str(configured(folder)))
    assert result.exit_code == code, result.output
    assert message in result.output
    no_traceback_of_ours(result)
    debug = runner.invoke(app, ["diagnose", str(configured(folder)), "--debug"])
    assert debug.exception is error  # --debug lets it through, traceback and all


HOSTILE_YAML = [
    ("alias bomb", "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)), "aliases expand to more than"),
    ("alias inside itself", "model: &m [*m]\n", "an alias refers to itself"),
    ("absurd nesting", "model: " + "[" * 5000 + "]" * 5000 + "\n", "nested more than 64 levels deep"),
    ("huge file", "# " + "x" * (64 << 20) + "\n", "more than the limit of 67108864 (64 MiB)"),
    ("steps past the index range", BASE.replace("steps: 3", f"steps: {2**63}"), "steps: expected a value less than or equal to"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "text", "message"), HOSTILE_YAML, ids=[h[0] for h in HOSTILE_YAML]
)
def test_hostile_yaml_is_refused_quickly(folder, name, text, message):
    (folder / "config.yaml").write_text(text)
    started = time.perf_counter()
    result = diagnose(str(folder / "config.yaml"))
    assert time.perf_counter() - started < 10
    assert result.exit_code == 2, result.output
    assert message in result.output
    no_traceback_of_ours(result)


def test_a_config_that_carries_260000_weights_runs_like_any_other(folder):
    """A 5.4 MB config (it was 'the config is 5460322 bytes, more than the limit of
    1048576'): the limits are for what never ends or multiplies, not for data."""
    rng = random.Random(0)
    weights = ", ".join(repr(rng.random()) for _ in range(260_000))
    config = configured(folder, f"data: faults.py:weighted\ndata_args: {{weights: [{weights}]}}")
    assert config.stat().st_size > 5_000_000
    result = diagnose(str(config), "--json", "report.json", "--no-verify")
    assert result.exit_code == 0, result.output[-2000:]
    assert json.loads((folder / "report.json").read_text())["steps_completed"] == 3


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/dev/zero"], "/dev/zero: the config is more than the limit of 67108864 bytes (64 MiB)"),
        (["CONFIG", "--baseline", "/dev/zero"], "--baseline /dev/zero: not a baseline: more than"),
    ],
)
def test_a_file_that_never_ends_is_read_up_to_its_limit_not_to_the_memorys(folder, args, message):
    # a device or a pipe has no size: what is read is counted (it filled 24 GiB)
    args = [str(configured(folder)) if a == "CONFIG" else a for a in args]
    result = diagnose(*args)
    assert result.exit_code == 2 and message in result.output, result.output
    no_traceback_of_ours(result)


@pytest.mark.parametrize(("option", "value"), [("--steps", str(2**63)), ("--seed", str(2**40))])
def test_numbers_past_what_the_platform_holds_are_usage_errors(folder, option, value):
    result = diagnose(str(configured(folder)), option, value)
    # typer's own usage error, naming the option (its wording is typer's)
    assert result.exit_code == 2 and f"Invalid value for '{option}'" in result.output
    no_traceback_of_ours(result)


CPU_OUT_OF_MEMORY = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
    "memory: you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"
)
# the CPU's allocator raises a plain RuntimeError (it was 'internal error: RuntimeError: ...')
NO_MEMORY = {
    "device": lambda: torch.OutOfMemoryError("CUDA out of memory (test)"),
    "host": lambda: RuntimeError(CPU_OUT_OF_MEMORY),
}
STAGES = {
    "capture": "saving the run's state to replay from",
    "restore": "rewinding to step 2",
}


@pytest.mark.parametrize("memory", list(NO_MEMORY))
@pytest.mark.parametrize("where", ["capture", "restore"])
def test_out_of_memory_in_snapshots_still_writes_the_report(folder, monkeypatch, where, memory):
    """The run stops keeping snapshots and goes on watching; the replay that needs one
    cannot run: its stage is named, what the run saw is written (exit 2, as every
    out-of-memory failure)."""

    def no_memory(self, *args):
        raise NO_MEMORY[memory]()

    if where == "capture":
        monkeypatch.setattr(StateSnapshot, "capture", no_memory)
    else:
        monkeypatch.setattr(StateSnapshot, "restore", no_memory)
    config = configured(folder, "data_args: {nan_at: 2}")
    result = diagnose(str(config), "--json", "report.json", "--no-verify")
    assert result.exit_code == 2, result.output
    stage = f"out of memory in the instrumented replay of step 2, {STAGES[where]}: "
    assert f"error: {stage}the report of what the run saw stands (step 2, phase input)" in (
        result.output
    )
    report = json.loads((folder / "report.json").read_text())
    assert report["status"] == "nonfinite" and report["first_nonfinite"]["step"] == 2
    assert report["first_nonfinite"]["reproduced"] is None  # not "the replay saw nothing"
    no_traceback_of_ours(result)


@pytest.mark.parametrize("memory", list(NO_MEMORY))
def test_out_of_memory_in_a_fixs_replay_leaves_that_fix_unverified(folder, monkeypatch, memory):
    from nandoctor.diagnose import verify

    def no_memory(*args, **kwargs):
        raise NO_MEMORY[memory]()

    monkeypatch.setattr(verify, "fast_run", no_memory)
    result = diagnose(str(configured(folder, "data_args: {nan_at: 2}")), "--json", "r.json")
    assert result.exit_code == 1, result.output  # found; the report written
    cause = json.loads((folder / "r.json").read_text())["causes"][0]
    assert cause["verified"] is None
    assert cause["verification"].endswith(": the replay ran out of memory")


ENV = Environment("cpu", "2.x", "float32", False, 1)


def test_a_run_the_users_code_ended_is_3_whatever_it_found_so_far():
    assert exit_code(of_report(Report("diagnose", "c.yaml", ENV, "error", 3))) == 3
    assert exit_code(of_baseline(Report("baseline", "c.yaml", ENV, "error", 3))) == 3


def test_interrupted_baseline_and_compare_are_130_not_1():
    report = Report("baseline", "c.yaml", ENV, "interrupted", 3)
    assert exit_code(of_baseline(report)) == 130
    env = CompareEnvironment("cpu", "2.x", 1)
    fp32 = CompareRun("float32", False, "healthy", 3, None, None, 0.5, None, 1.0)
    cut = CompareRun("float16", True, "interrupted", 1, None, None, 0.5, None, 1.0)
    assert exit_code(of_comparison(Comparison("c.yaml", env, [fp32, cut], ""))) == 130


@pytest.mark.slow
def test_a_thread_the_user_left_running_does_not_keep_diagnose_alive(folder):
    config = configured(folder, "loss: faults.py:starts_a_thread")
    command = [sys.executable, "-m", "nandoctor", "diagnose", str(config), "-q"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), *sys.path])}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "ending 1 thread(s) your code left running (user-sleeper)" in proc.stderr


WATCHED = """
import os
import torch
from torch import nn

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    print("step", step)  # the script's own stdout
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
os._exit(0)  # skips atexit, where a watched process writes what it saw
"""


def test_watch_never_writes_its_report_over_the_script(folder):
    (folder / "script.py").write_text(WATCHED)
    result = runner.invoke(app, ["watch", "--json", "script.py", "--", "python", "script.py"])
    assert result.exit_code == 2, result.output
    assert "is the run's command's file script.py; refusing to overwrite it" in result.output
    assert (folder / "script.py").read_text() == WATCHED


@pytest.mark.slow
def test_watch_reports_a_script_that_ends_with_os_exit_and_keeps_stdout_json(folder):
    (folder / "script.py").write_text(WATCHED)
    command = [sys.executable, "-m", "nandoctor", "watch", "--json", "-", "-q"]
    proc = subprocess.run(
        [*command, "--", sys.executable, "script.py"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=folder,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # the script's prints went to stderr
    assert report["status"] == "healthy" and report["steps_completed"] == 3
    assert "step 2" in proc.stderr


POOL_SCRIPT = """
import multiprocessing as mp
import torch
from torch import nn


def train(rank):
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(8, 4)
        if step == 2:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return rank


if __name__ == "__main__":
    with mp.get_context("spawn").Pool(2) as pool:  # a pool waits forever for a dead worker
        print(pool.map(train, range(2)))
"""


@pytest.mark.slow
def test_watch_returns_when_the_sentinel_stopped_a_pool_worker(folder):
    (folder / "pool.py").write_text(POOL_SCRIPT)
    command = [sys.executable, "-m", "nandoctor", "watch", "-q", "--no-replay"]
    started = time.perf_counter()
    proc = subprocess.run(
        [*command, "--", sys.executable, "pool.py"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=folder,
    )
    assert proc.returncode == 1, proc.stderr  # the NaN, found in a worker
    assert "step 2, phase input" in proc.stdout + proc.stderr
    assert time.perf_counter() - started < 200


RANKS_PY = """
import os
import signal
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def build_data(rank, world_size, kill_rank=None):
    g = torch.Generator().manual_seed(100 + rank)

    def batches():
        for i in range(8):
            if rank == kill_rank and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, a `kill -9`
            yield torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)

    return batches()
"""


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_with_exit_3_naming_it(tmp_path):
    (tmp_path / "ranks.py").write_text(RANKS_PY)
    (tmp_path / "config.yaml").write_text(
        "model: ranks.py:build_model\ndata: ranks.py:build_data\ndata_args: {kill_rank: 1}\n"
        "optimizer: {name: SGD, lr: 0.1}\nprecision: {dtype: float32}\nsteps: 6\ndevice: cpu\n"
        "distributed: {timeout_s: 30}\n"
    )
    command = [sys.executable, "-m", "nandoctor", "diagnose", str(tmp_path / "config.yaml")]
    proc = subprocess.run(
        [*command, "--nproc-per-node", "2", "-q"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 3, proc.stderr
    assert "rank 1 died: killed by SIGKILL" in proc.stderr
    assert "Traceback (most recent call last)" not in proc.stderr


@pytest.mark.parametrize("command", ["diagnose", "baseline"])
def test_a_report_never_overwrites_python_source_even_one_the_run_does_not_import(folder, command):
    (folder / "evaluate.py").write_text("print('my evaluation script')\n")
    option = "--out" if command == "baseline" else "--json"
    result = runner.invoke(app, [command, str(configured(folder)), option, "evaluate.py"])
    assert result.exit_code == 2, result.output
    assert (
        "--" in result.output and "evaluate.py: is a Python source file; refusing" in result.output
    )
    assert (folder / "evaluate.py").read_text() == "print('my evaluation script')\n"
