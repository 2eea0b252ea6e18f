"""Exit codes and the errors that map onto them.

Every error a user can fix is a `NandoctorError` carrying one line of text and its exit
code; the CLI prints that line and exits, never a traceback. An exception raised by the
user's own code is wrapped in `UserCodeError` so that the CLI can show the user's frames.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass  # NB: only where a run needs it: `lint` and `--help` load this module


class ExitCode(IntEnum):
    HEALTHY = 0  # the run stayed finite, or lint found nothing
    NONFINITE = 1  # a non-finite value was found (or lint findings, or a baseline broken)
    USAGE = 2  # bad command line, config, entrypoint or path
    USER_CODE = 3  # the user's own code raised
    INTERRUPTED = 130  # Ctrl-C or SIGTERM; a partial report is still written


def kind_of(value: object) -> str:
    """What a wrong value is, for a message: `None`, `an int`, `a str`, `an Accelerated...`."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


class NandoctorError(Exception):
    """An error the user can fix; its message is one line (plus an optional hint)."""

    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class ConfigError(NandoctorError):
    """The config file, a key in it, or an entrypoint it names is wrong (exit 2)."""


class UsageError(NandoctorError):
    """A command-line option or a path given on the command line is wrong (exit 2)."""


class UserCodeError(NandoctorError):
    """The user's model, data, loss or optimizer code raised while we called it (exit 3)."""

    exit_code = ExitCode.USER_CODE

    def __init__(self, where: str, error: BaseException) -> None:
        super().__init__(f"{where} raised {type(error).__name__}: {error}")
        self.where = where
        self.error = error
        # NB: the report of the run it ended, status "error" (diagnose): the CLI writes it
        # before the error is shown, as for sys.exit (a CI job keeps its report)
        self.report: Any = None

    def user_frames(self) -> list[traceback.FrameSummary]:
        """The traceback without the frames of nandoctor and of installed libraries.

        NB: when the error comes from deep inside torch (a shape mismatch, say) no user
        frame may be left; then the last library frame is kept so the message still points
        somewhere; never one of nandoctor's (the call itself raised: none to show).
        """
        frames = traceback.extract_tb(self.error.__traceback__)
        mine = [f for f in frames if is_user_file(f.filename)]
        return mine or [f for f in frames if not is_nandoctor_file(f.filename)][-1:]


_PACKAGE_DIR = Path(__file__).resolve().parent
_EXAMPLES_DIR = _PACKAGE_DIR / "examples"
_LIBRARY_DIRS = tuple(
    Path(p).resolve()
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
)


@functools.lru_cache(maxsize=4096)
def is_nandoctor_file(filename: str) -> bool:
    """True for nandoctor's own code (the shipped examples excepted)."""
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return path.is_relative_to(_PACKAGE_DIR) and not path.is_relative_to(_EXAMPLES_DIR)


@functools.lru_cache(maxsize=4096)
def is_user_file(filename: str) -> bool:
    """True for a file of the user's (or of our shipped examples), not of a library.

    The shipped examples count as user code: they stand in for a user's training script.
    """
    if filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    if path.is_relative_to(_EXAMPLES_DIR):
        return True
    if path.is_relative_to(_PACKAGE_DIR):
        return False
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return False
    return not any(path.is_relative_to(d) for d in _LIBRARY_DIRS)


def user_code(where: str) -> UserCall:
    """Run a call into the user's code; whatever it raises becomes a `UserCodeError`.

    `sys.exit()` (and `os._exit`, see `ProcessExit`) there is the user's code ending the
    run: a `UserExit` (exit 3). A `KeyboardInterrupt` stays one: the run is interrupted.
    The global torch settings the user's code changes stay the user's: they are put back
    for nandoctor's own work after the call, and again for the user's next call
    (`TorchGlobals`)."""
    return UserCall(where)


def _raise_user_error(where: str, e: Exception) -> None:
    if peer_failed(e):
        raise peer_failure(e, where) from e
    if out_of_memory(e):
        raise UserCodeOutOfMemory(where, e) from e
    raise UserCodeError(where, e) from e


def peer_failure(error: BaseException, where: str) -> PeerFailure:
    """The one line a rank prints when a collective failed because of another rank."""
    rank = os.environ.get("RANK", "?")
    if "Timed out" in str(error) or "timed out" in str(error):
        return PeerFailure(
            f"rank {rank}: another rank hung: no answer within distributed.timeout_s "
            f"during {where}",
            hint="a rank stuck in its data or its model; raise distributed.timeout_s if slow",
            hung=True,
        )
    return PeerFailure(
        f"rank {rank}: another rank failed or hung during {where}",
        hint="that rank's own error is printed above",
    )


def out_of_memory(error: BaseException) -> bool:
    """A `MemoryError`, or torch's out-of-memory error (`torch.OutOfMemoryError`, named
    `torch.cuda.OutOfMemoryError` before torch 2.5), or the RuntimeError of torch's CPU
    allocator ("[enforce fail at alloc_cpu.cpp:127] ... DefaultCPUAllocator: can't
    allocate memory"), which is no OutOfMemoryError. NB: torch is looked up, not
    imported: no torch, no torch error."""
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, RuntimeError) and any(s in str(error) for s in _ALLOCATORS_OUT):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(
        getattr(torch, "cuda", None), "OutOfMemoryError", None
    )
    return oom is not None and isinstance(error, oom)


def peer_failed(error: BaseException) -> bool:
    """In a rank of a data-parallel job: the error says another rank is gone or silent
    (torch.distributed's `DistError`s, or what gloo and NCCL say; by name, not by
    class: torch is not imported here)."""
    if "RANK" not in os.environ:  # not a worker of a data-parallel job
        return False
    if isinstance(error, OSError):  # this process's own file or pipe (`| head`): gloo and
        return False  # NCCL raise their "Broken pipe" as torch's errors, never as OSError
    name = type(error).__name__
    text = str(error)
    return name in ("DistError", "DistBackendError", "DistNetworkError") or any(
        s in text for s in _PEER_GONE
    )


# The global torch settings a user's code may change for its own purposes, and how to
# read and set each: nandoctor's own work (snapshots, checks, the tracer) runs with the
# values it started with, the user's calls with the values the user's code last left.
@functools.cache
def _globals() -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
    import torch

    return {
        "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
        "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
        "threads": (torch.get_num_threads, torch.set_num_threads),
    }


_user_globals: dict[str, Any] = {}  # what the user's code set, by name


@functools.cache
def _getters() -> tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]:
    """`_globals()`'s getters, in its order (NB: three: `TorchGlobals` reads them inline)."""
    first, second, third = (get for get, _ in _globals().values())
    return first, second, third


class TorchGlobals:
    """Around one call into the user's code: apply what the user's code set before,
    remember what it sets now, and put nandoctor's own values back afterwards.
    NB: a class, not a generator, and three C calls each way in the common case (nothing
    set, nothing changed), read inline: it runs around every call into the user's code,
    several a step, where Python meets caches the step's kernels have just emptied (a
    loop over `_globals()` there cost ~40 us a call on a 10 ms step)."""

    __slots__ = ("_before", "_ours")

    def __enter__(self) -> None:
        first, second, third = _getters()
        self._ours = self._before = (first(), second(), third())
        if _user_globals:
            settings = _globals()
            for name, value in _user_globals.items():
                settings[name][1](value)
            self._before = (first(), second(), third())

    def __exit__(self, *exc: object) -> None:
        first, second, third = _getters()
        now = (first(), second(), third())
        if now != self._before or now != self._ours:
            settings = _globals()
            for (name, (_, set_)), value, was, own in zip(
                settings.items(), now, self._before, self._ours, strict=True
            ):
                if value != was:
                    _user_globals[name] = value
                if value != own:
                    set_(own)


class UserCall(TorchGlobals):
    """`user_code`'s context: the torch settings kept apart, and the error translated."""

    __slots__ = ("where",)

    def __init__(self, where: str) -> None:
        self.where = where

    def __exit__(self, *exc: object) -> None:
        super().__exit__()
        error = exc[1] if len(exc) > 1 else None
        if error is None or isinstance(error, NandoctorError):
            return
        if isinstance(error, SystemExit):
            raise UserExit(self.where, error) from error
        if isinstance(error, Exception):
            _raise_user_error(self.where, error)


def changed_torch_globals() -> dict[str, Any]:
    """The global torch settings the user's code changed (for the report's notes)."""
    return dict(_user_globals)


def forget_torch_globals() -> None:
    """A new run starts from the process's own settings (tests run many in one process)."""
    _user_globals.clear()


class UserCodeOutOfMemory(UserCodeError):
    """The machine ran out of memory inside the user's code: the environment's limit, not
    a bug in that code (exit 2)."""

    exit_code = ExitCode.USAGE

    def __init__(self, where: str, error: BaseException) -> None:
        super().__init__(where, error)
        self.message = f"{where} ran out of memory: {memory_message(error)}"
        self.hint = "try a smaller batch or model, fewer --steps, or another --device"
        self.args = (self.message,)


class ProcessExit(SystemExit):
    """`os._exit(code)` called by the user's code while nandoctor runs it in-process
    (`cli.app` turns `os._exit` into this for the command's own process and thread)."""


class UserExit(UserCodeError):
    """The user's code called `sys.exit()`, `os._exit` or raised `SystemExit` (exit 3):
    the run ended there, not by a NaN."""

    def __init__(self, where: str, error: SystemExit) -> None:
        call = "os._exit" if isinstance(error, ProcessExit) else "sys.exit"
        super().__init__(where, error)
        self.message = f"{where} called {call}({error.code!r}): your code ended the run there"
        self.args = (self.message,)


class PeerFailure(NandoctorError):
    """In a data-parallel run, a collective failed because another rank died (exit 3).
    `hung`: it timed out (the other rank is still there, silent), rather than finding
    the other rank gone (which that rank's own error, or an interrupt, explains)."""

    exit_code = ExitCode.USER_CODE

    def __init__(self, message: str, hint: str | None = None, *, hung: bool = False) -> None:
        super().__init__(message, hint=hint)
        self.hung = hung


class RankDied(NandoctorError):
    """A rank of a data-parallel job was killed (a signal, the OOM killer) (exit 3)."""

    exit_code = ExitCode.USER_CODE


def memory_message(error: BaseException) -> str:
    """The first line of an out-of-memory error, without the CPU allocator's C++ check
    (`[enforce fail at alloc_cpu.cpp:127] err == 0. `), which says nothing to a user."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    return re.sub(r"^\[enforce fail at [^\]]*\]\s*(err == 0\.\s*)?", "", first) or first


# What torch's allocators that raise a plain RuntimeError say when memory runs out.
_ALLOCATORS_OUT = ("DefaultCPUAllocator: can't allocate memory", "MPS backend out of memory")

# What gloo and NCCL say when the other end of a collective is gone or silent.
_PEER_GONE = (
    "Connection closed by peer",
    "remote worker crashing",
    "Timed out",
    "Read error",
    "Connection reset by peer",
    "Broken pipe",
)
