"""Whose a source file is: the user's, nandoctor's own, or an installed library's.

A traceback shown to a user keeps the user's frames (`errors.UserCodeError.user_frames`),
a finding names the user's line (`localize.frames`), a guard of the origin op checks that
it is called from that line (`runtime.patches`), and a `Guard` names where the user's code
made it. Each asks here, by file name, with no import of torch.

It sits below every layer, `errors` included (a `UserCodeError` shows the user's frames);
nothing here imports anything of nandoctor.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

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
