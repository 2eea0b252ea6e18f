"""The first nandoctor code a watched process runs (from `boot/sitecustomize.py`).

It must cost nothing to a process that never uses torch (a shell tool, a DataLoader
worker that only reads files): it imports no torch and attaches nothing. It waits for
`import torch` to finish and only then attaches the sentinel (`child.attach`), so the
hooks are in place before the script's first line that touches a model.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Protocol, cast

from nandoctor.watch.protocol import Settings, raised_marker


def install() -> None:
    settings = Settings.from_env(os.environ)
    if settings is None:
        return
    atexit.register(_note_a_raise, settings.dir, os.getpid())
    if "torch" in sys.modules:
        _attach(settings)
    else:
        sys.meta_path.insert(0, _AfterImport("torch", lambda: _attach(settings)))


def _note_a_raise(folder: str, pid: int) -> None:
    """The process is dying of an uncaught exception (Python keeps the one it printed in
    `sys.last_value`): say so, so that `watch` exits 3, the user's code raised, and not
    the 1 Python exits with, which reads as "non-finite found". A Ctrl-C is no raise."""
    error = getattr(sys, "last_value", None)
    if os.getpid() != pid or error is None or isinstance(error, KeyboardInterrupt):
        return  # NB: a forked child inherits the handler, not the exception
    text = f"{type(error).__name__}: {error}".strip().splitlines()[0][:200]
    ours = [n for n in getattr(error, "__notes__", ()) if str(n).startswith("nandoctor: ")]
    if ours:  # NB: the way out nandoctor added to a library's error (a GradScaler's)
        text += f" ({str(ours[0]).removeprefix('nandoctor: ')[:600]})"
    with contextlib.suppress(OSError):
        raised_marker(folder, pid).write_text(text, encoding="utf-8")


def _attach(settings: Settings) -> None:
    try:
        from nandoctor.watch import child

        child.attach(settings)
    except Exception as e:  # NB: never break the user's program over the watch
        sys.stderr.write(f"nandoctor watch: not attached: {type(e).__name__}: {e}\n")


class _AfterImport(MetaPathFinder):
    """Calls `callback` once, right after the module `name` has been fully imported."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the other finders find the real module
        spec = _find(fullname, path, target)
        if spec is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = cast(_OneCall, spec.loader)
        run_module = loader.exec_module

        def exec_module(module: Any) -> None:
            run_module(module)
            del loader.exec_module  # NB: the loader is the real one again
            self.callback()

        loader.exec_module = exec_module
        return spec


class _OneCall(Protocol):
    """A loader as `_AfterImport` uses it: its `exec_module` replaced on the instance for
    one call (an attribute of the instance, over the class's method, then deleted)."""

    exec_module: Callable[[ModuleType], None]


def _find(fullname: str, path: Any, target: Any) -> ModuleSpec | None:
    for finder in sys.meta_path:
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is not None:
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
    return None
