"""The learning rate each step ran with, as a probe: the rate in effect at the failing
step, and the scheduler's jumps before it, are what learning-rate-too-high quotes.

A scheduler changes `param_groups[0]["lr"]` between steps, so the rate the optimizer
reads *at the start of a step* is the one that step trains with; reading it once after
the run gives the rate of the step after the last one, and the config gives neither.
Only the changes are kept (a constant rate is one entry), and reading a float costs no
device synchronisation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from nandoctor.causes.case import LrJump
from nandoctor.runtime.probe import Probe, StepContext


@dataclass
class LrHistory(Probe):
    """Probe: (step, lr) each time the largest param group's rate changed at a step's
    start (a fine-tuning run's new head at 30x its backbone's rate: the head's is the
    rate that diverges, and the one the fix must lower)."""

    changes: list[tuple[int, float]] = field(default_factory=list)
    forward_phase = False

    def step_started(self, ctx: StepContext) -> None:
        optimizer = ctx.session.optimizer
        if optimizer is None or not optimizer.param_groups:
            return
        lr = largest_rate(optimizer.param_groups)
        if lr is not None and (not self.changes or self.changes[-1][1] != lr):
            self.changes.append((ctx.step, lr))

    def at(self, step: int) -> float | None:
        """The rate in effect at `step` (None before the first step seen)."""
        rates = [lr for s, lr in self.changes if s <= step]
        return rates[-1] if rates else None

    def start(self) -> float | None:
        return self.changes[0][1] if self.changes else None

    def largest_jump(self, until: int) -> LrJump | None:
        """The step, up to `until`, at which the rate rose by the largest factor."""
        seen = [c for c in self.changes if c[0] <= until]
        jumps = [
            LrJump(step, before, after)
            for (_, before), (step, after) in itertools.pairwise(seen)
            if before > 0 and after > before
        ]
        return max(jumps, key=lambda j: j.factor, default=None)


def largest_rate(groups: list[dict]) -> float | None:
    """The largest learning rate among an optimizer's param groups (None: none is a number)."""
    rates = [r for g in groups if (r := number(g.get("lr"))) is not None]
    return max(rates, default=None)


def largest_group(groups: list[dict]) -> dict:
    """The param group with the largest learning rate (the first of equals), or {}."""
    return max(groups, key=lambda g: number(g.get("lr")) or 0.0, default={})


def number(value: object) -> float | None:
    """A param group's setting as a float: a number, or a one-element tensor (torch takes
    a tensor `lr`); None for anything else (a setting the optimizer does not have)."""
    if isinstance(value, torch.Tensor):
        return float(value.detach().cpu().item()) if value.numel() == 1 else None
    return float(value) if isinstance(value, (int, float)) else None
