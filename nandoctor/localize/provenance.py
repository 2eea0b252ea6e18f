"""Who made each tensor of the step, for the evidence: the ops that made the origin op's
inputs, one and two levels back (`← self came from aten._softmax.default at train.py:30`).
Weak references: a record lives as long as its tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from nandoctor.localize import ops
from nandoctor.report.evidence import Producer

_CAST = torch.ops.aten._to_copy.default


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
    def __init__(self) -> None:
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()

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
        made = Made(ops.op_name(func), module, source, phase.value, inputs, scalars)
        for t in out:
            self._made[t] = made

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
