"""Write reports atomically: a reader sees the old file or the whole new one, never half.

`-` means standard output. A missing or unwritable folder is the user's to fix (exit 2),
and so is a report that cannot be written at the end (a full disk, a folder gone): that
is never "non-finite" (1). The bytes go to a temporary file beside the target, then
`os.replace` moves it over the target; where that rename is refused (another file system
under a bind mount: EXDEV), the file is copied in place instead. A target that is not a
regular file (`/dev/stdout`, a FIFO) is written directly: nothing to replace there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from nandoctor.errors import UsageError

_report_stdout: list[IO[Any]] = []  # where `-` writes while user prints go to stderr


@contextlib.contextmanager
def report_stream(stream: IO[Any]) -> Iterator[None]:
    """Reports for `-` go to `stream` (the real stdout) while `sys.stdout` is redirected."""
    _report_stdout.append(stream)
    try:
        yield
    finally:
        _report_stdout.pop()


def _stdout() -> IO[Any]:
    return _report_stdout[-1] if _report_stdout else sys.stdout


def resolved(path: str) -> str:
    """`path` made absolute now: the user's code may change directory before the report
    is written (`-` stays `-`)."""
    return path if path == "-" else os.path.abspath(path)


_SOURCE_SUFFIXES = (".py", ".pyi", ".ipynb")


def check_writable(path: str, option: str) -> None:
    """Fail before a long run, not after it, when a report could not be written: a file
    is created in the folder and removed again (permissions alone do not say it: root
    passes every access check, and `/proc` refuses new files all the same)."""
    if path == "-":
        return
    if not path:
        raise UsageError(f"{option}: expected a file path or '-', got an empty string")
    refuse_an_option(path, option)
    if path.endswith(("/", os.sep)):  # NB: `--json out/` wrote a file named out
        raise UsageError(f"{option} {path}: ends in a folder, expected a file path")
    folder = Path(path).resolve().parent
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{option} {path}: {folder} is a file, not a folder")
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: folder {folder} does not exist")
    if Path(path).is_dir():
        raise UsageError(f"{option} {path}: is a folder, expected a file path")
    if Path(path).exists() and not Path(path).resolve().is_file():  # /dev/stdout, a FIFO
        return  # NB: written through, not replaced: the folder needs no new file
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".nandoctor-", suffix=".tmp"):
            pass
    except OSError as e:
        raise UsageError(
            f"{option} {path}: folder {folder} is not writable: {_reason(e)}"
        ) from None


def refuse_an_option(path: str, option: str) -> None:
    """`--junit $REPORT --fail-on-divergence` with REPORT unset hands the next option to
    `--junit` as its path: the run would lose both its report and its gate (exit 2)."""
    if path.startswith("-") and path != "-":
        raise UsageError(
            f"{option}: got the option {path!r} where a path was expected "
            f'(an unset variable left unquoted? quote it: {option} "$VAR")'
        )


def check_not_input(path: str | None, option: str, inputs: dict[str, Path]) -> None:
    """Refuse a report path that is one of the run's own files (the config, the
    checkpoint, a source file): writing the report would destroy it (exit 2)."""
    if not path or path == "-":
        return
    target = Path(path).resolve()
    for what, source in inputs.items():
        if source.exists() and target == source.resolve():
            raise UsageError(
                f"{option} {path}: is the run's {what}; refusing to overwrite it",
                hint="write the report to a new file",
            )
    if target.suffix in _SOURCE_SUFFIXES and target.is_file():
        # NB: one the run does not import (another script; a module of the process
        # `watch` runs) is someone's code all the same: no report is a .py
        raise UsageError(
            f"{option} {path}: is a Python source file; refusing to overwrite it",
            hint="write the report to a new file",
        )


def write_text(path: str, text: str, option: str = "output") -> None:
    write_bytes(path, text.encode("utf-8"), option)


def write_bytes(path: str, data: bytes, option: str = "output") -> None:
    """Write to a temporary file beside `path`, then rename it over `path`; any failure
    is one line naming the option and the path (exit 2), the old file left as it was."""
    try:
        if path == "-":
            _write_stdout(data)
            return
        check_writable(path, option)
        check_not_input(path, option, {})  # NB: a .py made since the run started
        _write_file(Path(path), data)
    except OSError as e:
        raise UsageError(f"{option} {path}: cannot write the report: {_reason(e)}") from None


def _write_stdout(data: bytes) -> None:
    stream = _stdout()
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        stream.flush()
        buffer.write(data)
        buffer.flush()
    else:  # a text stream without bytes underneath (a test runner's capture)
        stream.write(data.decode("utf-8"))
        stream.flush()


def _write_file(target: Path, data: bytes) -> None:
    if target.exists() and not target.is_file():  # /dev/stdout, a FIFO: write through
        with open(target, "wb") as f:  # NB: before resolving: /dev/stdout on a pipe
            f.write(data)  # resolves to /proc/self/fd/pipe:[N], a name that opens nothing
        return
    if target.is_symlink():  # the file it points to is the report; the link stays
        target = target.resolve()
    folder = target.resolve().parent
    mode = _mode_for(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        _move(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _move(tmp: str, target: Path) -> None:
    """`os.replace`, or a copy where the rename crosses devices (EXDEV, a bind mount)."""
    try:
        os.replace(tmp, target)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        shutil.copyfile(tmp, target)


def _mode_for(target: Path) -> int:
    """An existing report keeps its permissions; a new one gets the umask's (mkstemp's
    0600 would hide it from the CI user that uploads it)."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _reason(error: OSError) -> str:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device"
    return error.strerror or str(error)
