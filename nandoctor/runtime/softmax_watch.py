"""Softmax, log_softmax, scaled-dot-product attention and log, seen by a listener as they run.

A softmax's inputs can sit anywhere: in a model's attention, in the user's loss outside
any module (`torch.log(torch.softmax(logits, -1))`). No module hook sees them, so the few
callables are wrapped in torch while a listener listens (`runtime.wrappers`, where every
global patch is: `wrappers.listen_softmaxes`); this module says what each call tells the
listeners:

    torch.softmax(x, dim) / x.softmax(dim)        softmax_called(SOFTMAX, x, dim, out)
    torch.log_softmax(x, dim) / x.log_softmax(dim)
                                                  softmax_called(LOG_SOFTMAX, x, dim, out)
    F.scaled_dot_product_attention(q, k, v, ...)  attention_called(args, kwargs)
    torch.log(x) / x.log()                        log_called(x)  (a softmax's output logged?)

Each is told after the original ran (a log before), host-side only, and never while
`torch.compile` traces; a listener must never raise into the user's step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

SOFTMAX = "aten._softmax.default"
LOG_SOFTMAX = "aten._log_softmax.default"
SDPA = "aten.scaled_dot_product_attention"


class SoftmaxListener(Protocol):
    def softmax_called(self, op: str, x: torch.Tensor, dim: int, out: torch.Tensor) -> None: ...

    def attention_called(self, args: tuple, kwargs: dict[str, Any]) -> None: ...

    def log_called(self, x: torch.Tensor) -> None: ...


def tell_softmax(
    listeners: Sequence[SoftmaxListener], op: str, args: tuple, kwargs: dict[str, Any], out: Any
) -> None:
    """A softmax (or log_softmax) returned `out`: its input and dim, by position or name
    (`torch.softmax(input, dim)`, `x.softmax(dim)`)."""
    if not isinstance(out, torch.Tensor) or torch.compiler.is_compiling():
        return
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if isinstance(x, torch.Tensor) and isinstance(dim, int):
        for listener in list(listeners):
            listener.softmax_called(op, x, dim, out)


def tell_attention(
    listeners: Sequence[SoftmaxListener], args: tuple, kwargs: dict[str, Any]
) -> None:
    if torch.compiler.is_compiling():
        return
    for listener in list(listeners):
        listener.attention_called(args, kwargs)


def tell_log(listeners: Sequence[SoftmaxListener], args: tuple, kwargs: dict[str, Any]) -> None:
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if isinstance(x, torch.Tensor) and not torch.compiler.is_compiling():
        for listener in list(listeners):
            listener.log_called(x)


__all__ = [
    "LOG_SOFTMAX",
    "SDPA",
    "SOFTMAX",
    "SoftmaxListener",
    "tell_attention",
    "tell_log",
    "tell_softmax",
]
