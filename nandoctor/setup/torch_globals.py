"""The global torch settings a user's code may change for its own purposes: the default
dtype, grad mode and the number of threads.

nandoctor's own work (snapshots, checks, the tracer) runs with the values the process
started with; each call into the user's code (`setup.user_code`) runs with the values the
user's code last left, as if nandoctor's work had never been there. What the user's code
changed is kept for the report's notes (`changed_torch_globals`). NB: torch is imported
on the first call into the user's code, not with this module: `--help` stays torch-free.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


# The settings, and how to read and set each.
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


def changed_torch_globals() -> dict[str, Any]:
    """The global torch settings the user's code changed (for the report's notes)."""
    return dict(_user_globals)


def forget_torch_globals() -> None:
    """A new run starts from the process's own settings (tests run many in one process)."""
    _user_globals.clear()
