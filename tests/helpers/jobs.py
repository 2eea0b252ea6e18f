"""Jobs of several processes (torchrun's launcher and its ranks), run so that a hang
explains itself."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest


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
