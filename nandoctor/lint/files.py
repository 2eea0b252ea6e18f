"""Which files `nandoctor lint PATH...` reads.

A file named on the command line is always read (whatever its suffix). A folder is
searched recursively for `*.py` and Jupyter notebooks (`*.ipynb`), skipping hidden folders
(`.ipynb_checkpoints` too) and the usual homes of other people's code (virtual
environments, `site-packages`, `node_modules`, `__pycache__`) and paths matching the
config's `exclude` globs. A PATH that does not exist is a usage error.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from nandoctor.errors import UsageError

LINTED_SUFFIXES = (".py", ".ipynb")
SKIPPED_FOLDERS = frozenset({"venv", ".venv", "__pycache__", "site-packages", "node_modules"})


def discover(
    paths: Sequence[str | Path], exclude: Sequence[str] = (), root: Path | None = None
) -> list[Path]:
    """The files to lint, each once, in a stable order."""
    if not paths:
        raise UsageError("no PATH given", hint="nandoctor lint train.py (or a folder)")
    seen: dict[Path, Path] = {}
    for given in map(Path, paths):
        if not given.exists():
            raise UsageError(f"{given}: no such file or folder")
        found = [given] if given.is_file() else sorted(_walk(given, exclude, root or Path.cwd()))
        for path in found:
            seen.setdefault(path.resolve(), path)
    return list(seen.values())


def _walk(folder: Path, exclude: Sequence[str], root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not _skipped_folder(d) and not _excluded(here / d, exclude, root)
        )
        for name in filenames:
            path = here / name
            if name.endswith(LINTED_SUFFIXES) and not _excluded(path, exclude, root):
                yield path


def _skipped_folder(name: str) -> bool:
    return name.startswith(".") or name in SKIPPED_FOLDERS


def _excluded(path: Path, patterns: Sequence[str], root: Path) -> bool:
    if not patterns:
        return False
    try:
        relative = path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        relative = path.as_posix()
    return any(fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(path.name, p) for p in patterns)


def display_path(path: Path) -> str:
    """Relative to the working directory when inside it (what SARIF and editors want)."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)
