"""The few places PyTorch offers no global hook, wrapped once and shared by every listener.

PyTorch has global hooks for module forwards and optimizer steps, but none for "backward
was called on this loss", "this loss was scaled by a GradScaler", "this GradScaler step
began and ended" (a skipped step never calls `optimizer.step()`), "the gradients were
unscaled" or "the gradients were clipped to N". This module wraps exactly those callables:

    torch.autograd.backward                (Tensor.backward calls it through the module)
    torch.amp.GradScaler.scale / .step / .unscale_
                                           (torch.cuda.amp.GradScaler inherits them)
    torch.nn.utils.clip_grad_norm_         (both names users import it under, and the
                                           scaling it calls: a name imported before the
                                           patch still reaches that)
    torch.nn.utils.clip_grads_with_norm_   (that scaling's public name, after
                                           `get_total_norm`: accelerate clips so)

The wrappers are installed when the first listener registers and removed when the last
one leaves, so nested guards (a `Guard` inside a watched script) compose in any order.
A wrapper with no listener left behaves exactly like the original.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Protocol

import torch

from nandoctor.setup.scaler import explain_float16_unscale


class Listener(Protocol):
    """What a registered listener is told; each call is cheap and host-side only."""

    def backward_started(self, tensors: Any) -> None: ...

    def backward_ended(self, ok: bool) -> None: ...

    def scaled(
        self, scaler: torch.amp.GradScaler, loss: torch.Tensor, out: torch.Tensor
    ) -> None: ...

    def optimizer_entered(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None: ...

    def optimizer_exited(self, optimizer: torch.optim.Optimizer, ok: bool) -> None: ...

    def clipped(self, max_norm: float | None) -> None: ...

    def unscaled(self) -> None: ...


_listeners: list[Listener] = []
_originals: list[tuple[Any, str, Any]] = []  # (owner, attribute, original), in install order


def register(listener: Listener) -> None:
    if not _listeners:
        _install()
    _listeners.append(listener)


def unregister(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)
    if not _listeners:
        _uninstall()


def _install() -> None:
    import torch.nn.utils.clip_grad as clip_grad  # NB: the same function as torch.nn.utils'

    _patch(torch.autograd, "backward", _wrap_backward)
    _patch(torch.amp.GradScaler, "scale", _wrap_scale)
    _patch(torch.amp.GradScaler, "step", _wrap_scaler_step)
    _patch(torch.amp.GradScaler, "unscale_", _wrap_unscale)
    clip = _wrap_clip(torch.nn.utils.clip_grad_norm_)
    for owner in (torch.nn.utils, clip_grad):
        _originals.append((owner, "clip_grad_norm_", owner.clip_grad_norm_))
        owner.clip_grad_norm_ = clip  # type: ignore[attr-defined]  # re-exported there
    if hasattr(clip_grad, "_clip_grads_with_norm_"):  # NB: torch >= 2.6
        # `from torch.nn.utils import clip_grad_norm_` binds the function before any patch,
        # but it scales the gradients through this module-level name, looked up per call
        _patch(clip_grad, "_clip_grads_with_norm_", _wrap_clip)
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        # the same function's public name: `get_total_norm` then `clip_grads_with_norm_`,
        # the split form accelerate's `clip_grad_norm_` (and the Trainer's clip) imports
        _patch(torch.nn.utils, "clip_grads_with_norm_", _wrap_clip)


def _uninstall() -> None:
    while _originals:
        owner, name, original = _originals.pop()
        setattr(owner, name, original)


def _patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    _originals.append((owner, name, original))
    setattr(owner, name, wrap(original))


def _each(method: str, *args: Any) -> None:
    for listener in list(_listeners):
        getattr(listener, method)(*args)


_graph_keepers: list[Callable[[], bool]] = []


def keep_graph_when(keeper: Callable[[], bool]) -> None:
    """While `keeper()` says so, a backward keeps its graph (`retain_graph=True`): a
    rerun that recomputes a step's gradients at loss scale 1 from its unscaled loss
    (`watch/recheck.py`). Removed with `unkeep`; installs nothing by itself."""
    _graph_keepers.append(keeper)


def unkeep(keeper: Callable[[], bool]) -> None:
    if keeper in _graph_keepers:
        _graph_keepers.remove(keeper)


_asked_to_retain = False  # the last backward's own retain_graph (or create_graph)


def asked_to_retain() -> bool:
    """Whether the last backward's caller kept its graph itself (a loop that backwards
    through it again): whoever uses the graph after must then keep it too."""
    return _asked_to_retain


def _retaining(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`torch.autograd.backward`'s arguments with retain_graph=True (`Tensor.backward`
    passes it as the third positional one, create_graph as the fourth)."""
    global _asked_to_retain
    given = [*args[1:3], kwargs.get("retain_graph"), kwargs.get("create_graph")]
    _asked_to_retain = any(bool(v) for v in given if not isinstance(v, torch.Tensor))
    if len(args) >= 2:
        return (args[0], True, *args[2:]), kwargs
    return args, {**kwargs, "retain_graph": True}


def _wrap_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        _each("backward_started", tensors)
        if _graph_keepers and any(keep() for keep in _graph_keepers):
            args, kwargs = _retaining(args, kwargs)
        try:
            out = original(tensors, *args, **kwargs)
        except BaseException:
            _each("backward_ended", False)
            raise
        _each("backward_ended", True)
        return out

    return backward


def _wrap_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: torch.amp.GradScaler, outputs: Any) -> Any:
        out = original(self, outputs)
        if isinstance(outputs, torch.Tensor) and out is not outputs:  # enabled, one loss
            _each("scaled", self, outputs, out)
        return out

    return scale


def _wrap_scaler_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: torch.amp.GradScaler, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # NB: a skipped step never reaches optimizer.step(), so its hooks never fire:
        # the scaler's step is where a step of a GradScaler run begins and ends.
        _each("optimizer_entered", optimizer, self)
        try:
            out = original(self, optimizer, *args, **kwargs)
        except BaseException:
            _each("optimizer_exited", optimizer, False)
            raise
        _each("optimizer_exited", optimizer, True)
        return out

    return step


def _wrap_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_(self: torch.amp.GradScaler, optimizer: Any) -> Any:
        try:
            out = original(self, optimizer)
        except ValueError as e:  # NB: float16 weights: the user's error, with the way out
            explain_float16_unscale(e)
            raise
        _each("unscaled")
        return out

    return unscale_


def _wrap_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        # NB: float() of a tensor max_norm would be a host sync: only plain numbers are kept
        number = float(max_norm) if isinstance(max_norm, (int, float)) else None
        if number != math.inf:  # NB: an infinite max_norm measures the norm, clips nothing
            _each("clipped", number)
        return original(parameters, max_norm, *args, **kwargs)

    return clip_grad_norm_
