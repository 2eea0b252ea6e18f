"""Run the command watched: the first run and each rerun of `nandoctor watch`.

Free of torch on purpose: the command starts at once, while the modules that read its
results and write the report (torch among them, ~2 s) are imported beside it
(`importing`), instead of before it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nandoctor.errors import ExitCode, UsageError
from nandoctor.watch.protocol import ENV, Settings

BOOT_DIR = Path(__file__).resolve().parent / "boot"
GRACE_S = 10.0  # how long an interrupted command gets to write what it saw
POLL_S = 0.5  # how often a running command's folder is looked at
TIMED_OUT_CODE = 124  # a command stopped for taking too long (as `timeout(1)` exits)


@contextlib.contextmanager
def importing(*modules: str) -> Iterator[None]:
    """Import `modules` in a thread while the body runs (the command, which waits on its
    process), and wait for them at its end. NB: an import that fails is left to the
    caller's own import of the module, which raises it where it can be reported."""

    def load() -> None:
        for name in modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)

    loader = threading.Thread(target=load, name="nandoctor-imports", daemon=True)
    loader.start()
    try:
        yield
    finally:
        loader.join()


def run_command(
    command: list[str],
    settings: Settings,
    log: Path | None = None,
    timeout: float | None = None,
    stdout_to_stderr: bool = False,
    interrupt_raises: bool = False,
) -> int:
    """Run `command` watched; its exit code (128+N for signal N, 130 when interrupted,
    `TIMED_OUT_CODE` when stopped after `timeout` seconds).
    `interrupt_raises`: a Ctrl-C (or SIGTERM) stops the command, then raises
    KeyboardInterrupt (a rerun's end is not the command's)."""
    env = dict(os.environ)
    env[ENV] = settings.to_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BOOT_DIR), env.get("PYTHONPATH")) if p)
    out = open(log, "wb") if log is not None else None  # noqa: SIM115  (closed below)
    try:
        stdout: Any = out if out is not None else (sys.stderr if stdout_to_stderr else None)
        proc = subprocess.Popen(command, env=env, stdout=stdout, stderr=out)
    except (FileNotFoundError, PermissionError, NotADirectoryError) as e:
        raise UsageError(f"watch: cannot run {command[0]!r}: {e.strerror or e}") from None
    finally:
        if out is not None:
            out.close()
    return _wait(proc, timeout, settings.dir, interrupt_raises)


def _wait(
    proc: subprocess.Popen, timeout: float | None, folder: str, interrupt_raises: bool = False
) -> int:
    """The command's exit code. A process of the command that the sentinel stopped (a
    worker of a `multiprocessing.Pool`, whose pool would wait for it forever) gives the
    command `GRACE_S` to end by itself; then it is stopped."""
    deadline = None if timeout is None else time.monotonic() + timeout
    stopped_since: float | None = None
    try:
        while True:
            try:
                code = proc.wait(POLL_S)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    raise
                if stopped_since is None and any(Path(folder).glob("stopped-*")):
                    stopped_since = now
                if stopped_since is not None and now - stopped_since > GRACE_S:
                    _stop(proc)
                    code = proc.wait()
                    break
    except (KeyboardInterrupt, subprocess.TimeoutExpired) as e:  # Ctrl-C, SIGTERM, too long
        _stop(proc)
        if isinstance(e, subprocess.TimeoutExpired):
            return TIMED_OUT_CODE
        if interrupt_raises:
            raise
        return int(ExitCode.INTERRUPTED)
    return 128 - code if code < 0 else code


def _stop(proc: subprocess.Popen) -> None:
    """Stop the command the gentle way first: a Ctrl-C from the terminal reached it already;
    a SIGTERM sent to us did not, so it gets a SIGINT (Python then still writes what it saw),
    then SIGTERM, then SIGKILL."""
    steps = (
        (1.0, lambda: proc.send_signal(signal.SIGINT)),
        (GRACE_S, proc.terminate),
        (GRACE_S, proc.kill),
    )
    for wait_s, then in steps:
        try:
            proc.wait(wait_s)
            return
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            then()
    proc.wait()
