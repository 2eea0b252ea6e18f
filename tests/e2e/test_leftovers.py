"""Nothing nandoctor or its launcher makes in the temporary directory outlives the
command, however it ends: healthy, non-finite, the user's code raising, a config error,
SIGTERM, Ctrl-C; and for a data-parallel job a killed rank and a hung one too (torchrun's
`torchelastic_*` log folders were left behind). Each command runs with TMPDIR pointing at
a fresh folder, which must be empty afterwards.

NB: torch's compile cache (`torchinductor_<user>`, made when `torch._dynamo` is first
imported, which any optimizer's constructor does) is a cache meant to outlive every run,
the user's own training included: it is pointed elsewhere here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.jobs import run_job

TRAIN = """
import os
import pathlib
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def build_data(rank=0, world_size=1, nan_at=None, kill_rank=None, raise_at=None):
    g = torch.Generator().manual_seed(100 + rank)

    def batches():
        for i in range(8):
            if rank == kill_rank and i == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, a `kill -9`
            if i == raise_at:
                raise RuntimeError(f"could not read batch {i}")
            x = torch.randn(4, 8, generator=g)
            if i == nan_at:
                x[0, 0] = float("nan")
            yield x, torch.randint(0, 3, (4,), generator=g)

    return batches()


_calls = 0


def stops_at_step_2(model, batch, rank="0"):
    # one rank stops at step 2 (a stuck read, say), and says it got there
    global _calls
    _calls += 1
    if _calls == 3 and os.environ.get("RANK", "0") == rank:
        pathlib.Path("stepping").touch()
        time.sleep(600)
    x, y = batch
    return F.cross_entropy(model(x), y)


def rank_1_stops(model, batch):
    return stops_at_step_2(model, batch, rank="1")
"""

SCRIPT = """
import os
import pathlib
import sys
import time

import torch
from torch import nn

model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(8, 4)
    if step == 2 and sys.argv[1] == "nan":
        x[0, 0] = float("nan")
    if step == 2 and sys.argv[1] == "raise":
        raise RuntimeError("the script broke")
    if step == 2 and sys.argv[1] == "wait":
        pathlib.Path("stepping").touch()
        time.sleep(600)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "tmp").mkdir()
    return tmp_path


def environment(folder: Path) -> dict[str, str]:
    return {
        **os.environ,
        "TMPDIR": str(folder / "tmp"),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor-cache"),
        "PYTHONFAULTHANDLER": "1",
    }


def configured(folder: Path, extra: str = "") -> str:
    (folder / "config.yaml").write_text(
        "model: train.py:build_model\ndata: train.py:build_data\n"
        "optimizer: {name: SGD, lr: 0.1}\nprecision: {dtype: float32}\nsteps: 6\n"
        "device: cpu\ndistributed: {timeout_s: 5}\n" + extra
    )
    return str(folder / "config.yaml")


def diagnose(folder: Path, *options: str, ranks: int = 1) -> list[str]:
    spread = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    return [sys.executable, "-m", "nandoctor", "diagnose", configured(folder, *options[:1]),
            *spread, "--json", str(folder / "r.json"), "-q", "--no-verify"]  # fmt: skip


def left_in(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "tmp").iterdir())


def interrupted(command: list[str], folder: Path, signum: int) -> subprocess.CompletedProcess:
    """`command` sent `signum` once its run stopped at step 2 (the marker): a terminal's
    Ctrl-C (SIGINT) reaches the launcher, whose ranks run in sessions of their own."""
    marker = folder / "stepping"
    proc = subprocess.Popen(
        command, cwd=folder, env=environment(folder), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240  # NB: a bound on a hang, not a timing
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate(timeout=60)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


STOP_AT_2 = "loss: train.py:stops_at_step_2\n"

# (name, the config's extra lines, the exit code)
ENDINGS = [
    ("healthy", "", 0),
    ("non-finite", "data_args: {nan_at: 2}\n", 1),
    ("the user's code raised", "data_args: {raise_at: 2}\n", 3),
    ("a config error", "steps: 0\n", 2),
]


@pytest.mark.parametrize(("name", "extra", "code"), ENDINGS, ids=[e[0] for e in ENDINGS])
def test_one_process_leaves_nothing_behind(folder, name, extra, code):
    command = diagnose(folder, extra)
    proc = subprocess.run(
        command, cwd=folder, env=environment(folder), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == code, proc.stderr
    assert left_in(folder) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_one_process_stopped_by_a_signal_leaves_nothing_behind(folder, signum):
    proc = interrupted(diagnose(folder, STOP_AT_2), folder, signum)
    assert proc.returncode == 130, proc.stderr
    assert json.loads((folder / "r.json").read_text())["status"] == "interrupted"
    assert left_in(folder) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "extra", "code"),
    [
        *ENDINGS[:3],
        ("a killed rank", "data_args: {kill_rank: 1}\n", 3),
        ("a hung rank", "loss: train.py:rank_1_stops\n", 3),
    ],
    ids=[*(e[0] for e in ENDINGS[:3]), "a killed rank", "a hung rank"],
)
def test_a_data_parallel_job_leaves_nothing_behind(folder, name, extra, code):
    proc = run_job(diagnose(folder, extra, ranks=2), cwd=folder, env=environment(folder))
    assert proc.returncode == code, proc.stderr
    assert left_in(folder) == []  # it left torchelastic_*/<run id>/attempt_0/{0,1}


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_data_parallel_job_stopped_by_a_signal_leaves_nothing_behind(folder, signum):
    proc = interrupted(diagnose(folder, STOP_AT_2, ranks=2), folder, signum)
    assert proc.returncode == 130, proc.stderr
    assert left_in(folder) == []


def watch(how: str) -> list[str]:
    return [sys.executable, "-m", "nandoctor", "watch", "-q", "--", sys.executable, "script.py", how]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("how", "code"), [("healthy", 0), ("nan", 1), ("raise", 3)])
def test_watch_leaves_nothing_behind(folder, how, code):
    """A NaN is rechecked and replayed: the command runs again, with folders of its own."""
    proc = subprocess.run(
        watch(how), cwd=folder, env=environment(folder), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == code, proc.stderr
    assert left_in(folder) == []


@pytest.mark.slow
def test_watch_stopped_by_ctrl_c_leaves_nothing_behind(folder):
    proc = interrupted(watch("wait"), folder, signal.SIGINT)
    assert proc.returncode == 130, proc.stderr
    assert left_in(folder) == []
