"""Who made each tensor of the step, for the evidence: the ops that made the origin op's
inputs, one and two levels back (`← self came from aten._softmax.default at train.py:30`).
Weak references: a record lives as long as its tensor.

An op that guards a value from 0 (`var + eps`, `clamp_min(eps)`, `maximum(n, eps)`,
`where(n > eps, n, eps)`) may get its epsilon as a tensor rather than a number: a buffer
(`register_buffer("eps", torch.tensor(1e-8))`), a one-element tensor made outside the
step, or a fill (`full_like(n, 1e-8)`). Such a constant is written beside the op's plain
numbers, with where it came from: `other=1e-08 (buffer norm.eps)`, `other=1e-08
(full_like)`, so that the rules see an epsilon however it was given (a float16 buffer
holds the 0 its dtype made of it: `other=0 (buffer norm.eps)`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from nandoctor.localize import ops
from nandoctor.report.evidence import Producer

_CAST = torch.ops.aten._to_copy.default

# NB: ops an epsilon rides on, by torch's name of the op (in-place forms too)
_GUARDS = frozenset(
    {"add", "add_", "clamp", "clamp_", "clamp_min", "clamp_min_", "maximum", "fmax", "where"}
)
# NB: ops that make a tensor of one value from a plain number: an epsilon given as a tensor
_FILLS = frozenset({"full", "full_like", "new_full", "scalar_tensor", "fill", "fill_"})

NameOf = Callable[[torch.Tensor], "str | None"]  # "buffer norm.eps" for a model's own tensor


@dataclass(frozen=True)
class Made:
    """Who made a tensor."""

    op: str
    module: str | None
    source: str | None
    phase: str
    inputs: tuple[tuple[str, Made | None], ...]
    scalars: tuple[str, ...]


class Provenance:
    def __init__(self, name_of: NameOf | None = None) -> None:
        """`name_of`: the name of a model's buffer or parameter (None for other tensors)."""
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._name_of = name_of or (lambda t: None)

    def record(
        self, func: Any, args: tuple, kwargs: dict, out: list[torch.Tensor], where: tuple
    ) -> None:
        phase, module, source, _ = where
        inputs = tuple((n, self._made.get(t)) for n, t in ops.named_tensors(func, args, kwargs))
        if func is _CAST and inputs and inputs[0][1] is not None:
            # NB: an autocast cast (softmax's input taken to float32, as CUDA autocast
            # does) is not who made the values: the copy keeps its input's maker
            for t in out:
                self._made[t] = inputs[0][1]
            return
        scalars = tuple(ops.scalars_text(func, args, kwargs))
        if func.overloadpacket.__name__ in _GUARDS:
            scalars += tuple(self._constants(func, args, kwargs))
        made = Made(ops.op_name(func), module, source, phase.value, inputs, scalars)
        for t in out:
            self._made[t] = made

    def _constants(self, func: Any, args: tuple, kwargs: dict) -> Iterator[str]:
        """The tensor arguments of a guard that are constants (see the module's docstring),
        as `name=value (where from)`; the values the step computed are data, not these."""
        for name, t in ops.named_tensors(func, args, kwargs):
            made = self._made.get(t)
            if made is not None and made.op.split(".")[1] in _FILLS:
                value = next((v for v in map(_number, made.scalars) if v is not None), None)
                if value is not None:
                    yield f"{name}={value:.6g} ({made.op.split('.')[1]})"
            elif made is None and t.numel() == 1 and t.is_floating_point() and not t.is_meta:
                given = self._name_of(t) or f"a {str(t.dtype).removeprefix('torch.')} tensor"
                yield f"{name}={float(t.detach().reshape(())):.6g} ({given})"

    def producers(self, func: Any, args: tuple, kwargs: dict) -> list[Producer]:
        """The makers of the op's inputs (depth 1) and of their inputs (depth 2)."""
        out: list[Producer] = []
        for name, t in ops.named_tensors(func, args, kwargs):
            made = self._made.get(t)
            if made is None:
                continue
            out.append(_producer(made, 1, name))
            out.extend(_producer(m, 2, n) for n, m in made.inputs if m is not None)
        return out


def _producer(made: Made, depth: int, feeds: str) -> Producer:
    return Producer(made.op, made.module, made.source, made.phase, depth, feeds, list(made.scalars))


def _number(text: str) -> float | None:
    """The float of a plain-number argument ("fill_value=1e-08"); None for a bool or int."""
    value = text.partition("=")[2]
    if value in ("True", "False") or ("." not in value and "e" not in value):
        return None
    try:
        return float(value)
    except ValueError:
        return None
