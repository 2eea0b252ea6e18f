"""Keep the memory a training step frees for the next step, in nandoctor's own processes.

A CPU training step frees its gradients and activations and allocates them again in the
next. glibc's malloc hands the top of its heap back to the kernel as soon as more than its
trim threshold lies free there (a threshold that follows the largest block freed so far: a
few MiB on a model of a few million parameters), and the next step maps the same memory
again, one page fault per 4 KiB. Measured on a float32 MLP of 3.2 million parameters (28
ms of user time a step): the plain loop, with nothing of nandoctor's, took 1,700 to 7,300
page faults a step, 1 to 10 ms of system time, how many depending only on where its heap's
blocks happened to lie (the same script under another PYTHONHASHSEED); with the thresholds
below, 32.

`diagnose`, `compare` and `baseline` run the user's loop in nandoctor's own process, so
they set the thresholds once, before the run (`keep_freed_memory`): blocks up to 32 MiB
(the largest glibc's own rule raises its threshold to) come from the heap, and what a step
frees stays there for the next. A process that holds its peak anyway loses nothing by it.
The user's own processes (`watch`, `Guard`) are left as they are, and so is a malloc the
user's environment already tunes.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit systems
TRIM_THRESHOLD = 2**31 - 1  # the largest mallopt's int takes: never trim in practice
# The same settings, as the environment variables glibc reads when a process starts (the
# benchmark runs the plain loop with them too, to tell them from nandoctor's own cost)
GLIBC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD),
}


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process; False where nothing was set:
    not glibc, or the environment already tunes malloc (the user's choice stands)."""
    if not _glibc() or _tuned(os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    # NB: either call alone turns off glibc's own rule for both thresholds
    mmap_set = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(mmap_set and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):  # not a glibc system (or not POSIX)
        return False


def _tuned(environ: os._Environ[str] | dict[str, str]) -> bool:
    """Whether the environment sets any of malloc's tunables itself."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    return any(key.startswith("MALLOC_") for key in environ) or "glibc.malloc." in tunables
