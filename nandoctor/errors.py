"""Exit codes and the errors that map onto them.

Every error a user can fix is a `NandoctorError` carrying one line of text and its exit
code; the CLI prints that line and exits, never a traceback. An exception raised by the
user's own code is wrapped in `UserCodeError` (at the user-code boundary,
`setup.user_code`) so that the CLI can show the user's frames.
"""

from __future__ import annotations

import re
import sys
import traceback
from enum import IntEnum
from typing import Any

from nandoctor.user_files import is_nandoctor_file, is_user_file


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
