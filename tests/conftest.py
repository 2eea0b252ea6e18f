"""Shared fixtures: a throwaway project folder holding a user's train.py and config.yaml."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_global_patch_outlives_its_test():
    """A test that leaves nandoctor's global patches on (a guard never closed) changes every
    test after it: a fix replay then meets torch's softmax wrapped. Fail that test, then
    give torch its callables back."""
    from nandoctor.runtime import wrappers

    yield
    left = sorted(set(wrappers._patched.values()))
    for patches in (wrappers._STEPS, wrappers._SOFTMAXES):
        for listener in list(patches.listeners):
            patches.unregister(listener)
    assert not left, f"nandoctor's global patches left on after the test: {left}"


CONFIGS = REPO / "configs"

# A user's training module: small, real, and configurable through model_args/data_args.
TRAIN_PY = """
import torch
import torch.nn.functional as F
from torch import nn


def build_model(features=8, classes=3):
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))


def build_data(
    batches=4, batch_size=8, features=8, classes=3, nan_at=None, inf_at=None, zero_feature=False
):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        x = torch.randn(batch_size, features, generator=g)
        if zero_feature:
            x[:, 0] = 0.0
        if nan_at is not None and i == nan_at:
            x[0, 0] = float("nan")
        if inf_at is not None and i == inf_at:
            x[1, 1] = float("inf")
        out.append((x, torch.randint(0, classes, (batch_size,), generator=g)))
    return out


def batches_generator(batches=3):
    for x, y in build_data(batches=batches):
        yield x, y


def no_data():
    return []


def not_iterable():
    return 42


def raises():
    raise RuntimeError("the user's builder broke")


NOT_CALLABLE = 3
"""


@pytest.fixture
def project(tmp_path: Path):
    """Returns `write(config: dict | str, code: str = TRAIN_PY) -> Path` of the config."""

    def write(config: dict | str, code: str = TRAIN_PY, name: str = "config.yaml") -> Path:
        (tmp_path / "train.py").write_text(textwrap.dedent(code))
        path = tmp_path / name
        text = config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False)
        path.write_text(textwrap.dedent(text))
        return path

    return write


def base_config(**overrides) -> dict:
    """A small healthy float32 run of train.py."""
    config = {
        "model": "train.py:build_model",
        "data": "train.py:build_data",
        "optimizer": {"name": "SGD", "lr": 0.1},
        "precision": {"dtype": "float32"},
        "steps": 6,
        "device": "cpu",
    }
    config.update(overrides)
    return config


def run_job(command: list[str], *, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run a job of several processes (torchrun's launcher and its ranks). One that hangs
    fails the test with every process's Python stacks (faulthandler, on SIGABRT to each),
    so that a hang in CI explains itself."""
    env = {**kwargs.pop("env", os.environ), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _signal_job(proc.pid, signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _signal_job(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(command[1:4])} hung for {timeout} s; the stacks:\n{err[-8000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _signal_job(pid: int, signum: int) -> None:
    """`signum` to the ranks first, then to their launcher (`pid`). NB: not by process
    group: torch's launcher starts each rank in a session of its own."""
    for each in [*reversed(_descendants(pid)), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(each, signum)


def _descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (Linux's /proc), parents first."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                out += [int(child), *_descendants(int(child))]
    return out
