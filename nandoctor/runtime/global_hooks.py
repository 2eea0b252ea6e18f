"""nandoctor's hooks in torch's global hook tables, under keys of its own.

torch numbers every hook handle from one process-wide counter (`RemovableHandle.next_id`),
and a module keeps its own hooks in dicts keyed by those numbers, which `torch.save(model)`
pickles. A handle of nandoctor's drawn from that counter shifts the number of every hook
the user registers after it, and so the bytes of a model saved whole (the forecast's hook
comes and goes each step). So nandoctor's global hooks go into torch's tables directly,
under negative keys (torch's count up from 0), and `remove` takes each out of every table
it went into (NB: torch's own handle leaves a `with_kwargs` forward hook's id behind,
after which `torch.compile(module)` warns about global hooks at every call, for good)::

    handle = global_hooks.module_forward(hook, with_kwargs=True, always_call=True)
    ...                  # torch calls hook(module, args, kwargs, output) after each module
    handle.remove()
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module

_keys = itertools.count(-1, -1)


@dataclass(frozen=True)
class Handle:
    key: int
    tables: tuple[MutableMapping[int, Any], ...]

    def remove(self) -> None:
        for table in self.tables:
            table.pop(self.key, None)


def _add(table: MutableMapping[int, Any], hook: Any, *flags: MutableMapping[int, Any]) -> Handle:
    key = next(_keys)
    for flag in flags:
        flag[key] = True
    table[key] = hook
    return Handle(key, (table, *flags))


def module_forward_pre(hook: Callable[..., Any]) -> Handle:
    """As `register_module_forward_pre_hook(hook)`."""
    return _add(nn_module._global_forward_pre_hooks, hook)


def module_forward(
    hook: Callable[..., Any], *, with_kwargs: bool = False, always_call: bool = False
) -> Handle:
    """As `register_module_forward_hook(hook, with_kwargs=..., always_call=...)`."""
    flags = [
        table
        for table, wanted in (
            (nn_module._global_forward_hooks_with_kwargs, with_kwargs),
            (nn_module._global_forward_hooks_always_called, always_call),
        )
        if wanted
    ]
    return _add(nn_module._global_forward_hooks, hook, *flags)


def optimizer_step_pre(hook: Callable[..., Any]) -> Handle:
    """As `register_optimizer_step_pre_hook(hook)`."""
    return _add(optim_module._global_optimizer_pre_hooks, hook)


def optimizer_step_post(hook: Callable[..., Any]) -> Handle:
    """As `register_optimizer_step_post_hook(hook)`."""
    return _add(optim_module._global_optimizer_post_hooks, hook)


def remove(handles: list[Handle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


__all__ = [
    "Handle",
    "module_forward",
    "module_forward_pre",
    "optimizer_step_post",
    "optimizer_step_pre",
    "remove",
]
