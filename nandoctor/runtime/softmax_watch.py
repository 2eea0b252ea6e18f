"""Softmax, log_softmax, scaled-dot-product attention and log, seen by a listener as they run.

A softmax's inputs can sit anywhere: in a model's attention, in the user's loss outside
any module (`torch.log(torch.softmax(logits, -1))`). No module hook sees them, and a
`TorchFunctionMode` would cost every torch call of every step. So the few callables are
wrapped, while at least one listener is registered (`listen`), and restored after::

    torch.softmax          torch.Tensor.softmax       (F.softmax and nn.Softmax call it)
    torch.log_softmax      torch.Tensor.log_softmax   (F.log_softmax calls it)
    torch.nn.functional.scaled_dot_product_attention
    torch.log              torch.Tensor.log           (to see a softmax's output logged)

A wrapper calls the original first and tells the listeners after, host-side only; a
listener must never raise into the user's step. NB: `F.softmax` is not wrapped itself:
it calls `input.softmax(dim)`, and the wrapper of `Tensor.softmax` sees that call, so no
function of `torch.nn.functional` changes identity. With a `TorchFunctionMode` of the
user's active, a method call can reach the wrapper twice (the mode sees the wrapper as
the method): a listener is told once.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

SOFTMAX = "aten._softmax.default"
LOG_SOFTMAX = "aten._log_softmax.default"
SDPA = "aten.scaled_dot_product_attention"


class Listener(Protocol):
    def softmax_called(self, op: str, x: torch.Tensor, dim: int, out: torch.Tensor) -> None: ...

    def attention_called(self, args: tuple, kwargs: dict[str, Any]) -> None: ...

    def log_called(self, x: torch.Tensor) -> None: ...


_listeners: list[Listener] = []
_originals: dict[tuple[Any, str], Any] = {}  # (owner, name) -> its own attribute, or _ABSENT
_ABSENT = object()
_inside = threading.local()  # NB: a wrapper reached again from within (a user's mode)


def listen(listener: Listener) -> None:
    """Register; the first listener installs the wrappers."""
    if not _listeners:
        _install()
    _listeners.append(listener)


def stop_listening(listener: Listener) -> None:
    """Unregister; the last listener to leave restores the originals."""
    if listener in _listeners:
        _listeners.remove(listener)
        if not _listeners:
            _restore()


def _tell(notify: Callable[[Listener], None]) -> None:
    if torch.compiler.is_compiling():
        return
    for listener in list(_listeners):
        notify(listener)


def _outermost(original: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The original's result, and whether this call is the outermost of the wrappers (a
    user's mode can route a method call through the wrapper again)."""
    depth = getattr(_inside, "depth", 0)
    _inside.depth = depth + 1
    try:
        return original(*args, **kwargs), depth == 0
    finally:
        _inside.depth = depth


def _softmax_wrapper(original: Callable[..., Any], op: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out, outermost = _outermost(original, args, kwargs)
        if outermost and _listeners and isinstance(out, torch.Tensor):
            x = args[0] if args else kwargs.get("input", kwargs.get("self"))
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(x, torch.Tensor) and isinstance(dim, int):
                _tell(lambda listener: listener.softmax_called(op, x, dim, out))
        return out

    return wrapper


def _attention_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out, outermost = _outermost(original, args, kwargs)
        if outermost and _listeners:
            _tell(lambda listener: listener.attention_called(args, kwargs))
        return out

    return wrapper


def _log_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _listeners and not getattr(_inside, "depth", 0):
            x = args[0] if args else kwargs.get("input", kwargs.get("self"))
            if isinstance(x, torch.Tensor):
                _tell(lambda listener: listener.log_called(x))
        return _outermost(original, args, kwargs)[0]

    return wrapper


def _targets() -> list[tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]]:
    softmax = functools.partial(_softmax_wrapper, op=SOFTMAX)
    log_softmax = functools.partial(_softmax_wrapper, op=LOG_SOFTMAX)
    return [
        (torch, "softmax", softmax),
        (torch.Tensor, "softmax", softmax),
        (torch, "log_softmax", log_softmax),
        (torch.Tensor, "log_softmax", log_softmax),
        (F, "scaled_dot_product_attention", _attention_wrapper),
        (torch, "log", _log_wrapper),
        (torch.Tensor, "log", _log_wrapper),
    ]


def _install() -> None:
    for owner, name, wrap in _targets():
        _originals[(owner, name)] = vars(owner).get(name, _ABSENT)
        setattr(owner, name, wrap(getattr(owner, name)))


def _restore() -> None:
    for (owner, name), original in _originals.items():
        if original is _ABSENT:
            delattr(owner, name)  # NB: the class's own attribute shows through again
        else:
            setattr(owner, name, original)
    _originals.clear()


__all__ = ["LOG_SOFTMAX", "SDPA", "SOFTMAX", "Listener", "listen", "stop_listening"]
