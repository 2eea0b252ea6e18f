"""nandoctor's own processes keep the memory a step frees for the next step: a step that
frees and allocates again what the step before did maps no page afresh (runtime/host_memory)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nandoctor.runtime.host_memory import GLIBC_ENV, _tuned

# A step's gradients, as torch's CPU allocator gets them: four 4 MiB blocks from malloc,
# written, then freed; the page faults of ten steps after five to settle in. NB: ctypes'
# malloc, not tensors: nothing else is allocated between the blocks (a tensor's small
# bookkeeping lying above them would keep glibc from trimming, as luck has it)
STEPS = """
import ctypes, resource, sys
from nandoctor.runtime.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
def step():
    blocks = [libc.malloc(4 * 2**20) for _ in range(4)]
    for block in blocks:
        ctypes.memset(block, 1, 4 * 2**20)
    for block in blocks:
        libc.free(block)
for _ in range(5):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"),
    reason="glibc's malloc only",
)


def _faults(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("GLIBC_TUNABLES", None)
    done = subprocess.run(
        [sys.executable, "-c", STEPS, mode],
        env={**clean, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        check=True,
    )
    kept, faults = done.stdout.split()
    return kept, int(faults)


@glibc
def test_a_step_reuses_the_memory_the_step_before_freed():
    kept, faults = _faults("keep")
    assert kept == "True"
    assert faults < 100  # none, where no other process's work moves a page (0 here)


@glibc
def test_without_it_every_step_maps_its_memory_again():
    # NB: what keep_freed_memory is for: glibc returns the freed top of its heap to the
    # kernel, a fault per 4 KiB page when the next step writes it (16 MiB: 4,096 a step)
    kept, faults = _faults("leave")
    assert kept == "False"
    assert faults > 10 * 3000


@glibc
def test_the_users_own_malloc_settings_stand():
    kept, _ = _faults("keep", MALLOC_ARENA_MAX="2")
    assert kept == "False"
    assert _tuned({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not _tuned({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"})


@glibc
def test_the_environment_variables_are_the_same_settings():
    # the benchmark runs the plain loop with them: it then faults no more than nandoctor's
    _, faults = _faults("leave", **GLIBC_ENV)
    assert faults < 100
