"""Write reports atomically: a reader sees the old file or the whole new one, never half.

`-` means standard output. A missing or unwritable folder is the user's to fix (exit 2).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from nandoctor.errors import UsageError


def check_writable(path: str, option: str) -> None:
    """Fail before a long run, not after it, when a report could not be written."""
    if path == "-":
        return
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path}: folder {folder} is not writable")
    if Path(path).is_dir():
        raise UsageError(f"{option} {path}: is a folder, expected a file path")


def write_text(path: str, text: str, option: str = "output") -> None:
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    write_bytes(path, text.encode("utf-8"), option)


def write_bytes(path: str, data: bytes, option: str = "output") -> None:
    """Write to a temporary file beside `path`, then rename it over `path`."""
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
        return
    check_writable(path, option)
    target = Path(path)
    folder = target.resolve().parent
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
