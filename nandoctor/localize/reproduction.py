"""Did the replay reproduce the failure, and exactly? `reproduction` holds what the replay
recomputed against what the run recorded, the way Megatron-LM's rerun state machine tells
a deterministic failure from a transient one: run the step again from the same state and
compare its result with the first run's, with no tolerance.

What is compared is what both record: each step's loss. The run's sentinel keeps every
step's loss in the telemetry; the replay recomputes the loss of each step it runs (the
kept steps from the snapshot on, then the failing one, under the tracer) in the same way
(`StepLoss`: a followed loop's parts summed, nandoctor's micro-batches averaged), so a
deterministic replay gives the same numbers, bit for bit:

- `exact`: the replay went non-finite, and every loss it recomputed equals the run's (a
  NaN equals a NaN, an inf an inf of its sign);
- `values-differ`: it went non-finite too, but some loss differs: nondeterministic
  kernels (a GPU's atomic adds), noise the run draws from outside the RNGs a snapshot
  keeps (the clock, `os.urandom`), or state the replay does not rewind;
- `not-reproduced`: it ran the step and saw nothing non-finite: a transient (a fault of
  the hardware, a race), or a nondeterminism that decided the failure itself;
- None: nothing was replayed, or the replay could not run the step (it ended before it,
  ran out of memory, found no snapshot, or the user's code raised).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from nandoctor.runtime.probe import Phase, Probe, StepContext

if TYPE_CHECKING:
    from nandoctor.localize.replay import Localization

Word = Literal["exact", "values-differ", "not-reproduced"]
EXACT: Word = "exact"
VALUES_DIFFER: Word = "values-differ"
NOT_REPRODUCED: Word = "not-reproduced"


@dataclass(frozen=True)
class Reproduction:
    """The word, and the first step whose loss differed from the run's, if one did (for
    `not-reproduced`: the replay did not begin the step from the run's state)."""

    word: Word
    step: int | None = None
    run: float | None = None  # that step's loss in the run
    replay: float | None = None  # and in the replay


def reproduction(
    located: Localization | None, recorded: Mapping[int, float] | None
) -> Reproduction | None:
    """How the replay's numbers held against the run's (`recorded`: each step's loss)."""
    if located is None or not located.reached or located.failed:
        return None
    differ = next(
        (
            (step, run, replay)
            for step, replay in sorted(located.losses.items())
            if (run := (recorded or {}).get(step)) is not None and not same(run, replay)
        ),
        (None, None, None),
    )
    if located.finding is None:  # NB: with a difference: the replay left the run's path
        return Reproduction(NOT_REPRODUCED, *differ)
    return Reproduction(VALUES_DIFFER, *differ) if differ[0] is not None else Reproduction(EXACT)


def same(a: float, b: float) -> bool:
    """Bit for bit, as far as a float says: equal, or NaN both (`-0.0 == 0.0` too)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def mean_losses(each: Iterable[Mapping[int, float]]) -> dict[int, float]:
    """The losses of a data-parallel replay, one mapping per rank, as the run's telemetry
    keeps them: each step's mean over the ranks (in rank order, as the sentinel takes it);
    a step some rank did not record is left out."""
    ranks = list(each)
    steps = set.intersection(*(set(r) for r in ranks)) if ranks else set()
    return {s: statistics.fmean(r[s] for r in ranks) for s in sorted(steps)}


class StepLoss(Probe):
    """A replayed step's loss, as the sentinel keeps it: the sum of the parts a followed
    loop backpropagates, the mean of nandoctor's own micro-batches'. `quiet`: the tracer's,
    so that reading the loss is not traced as an op of the step."""

    forward_phase = False

    def __init__(self, quiet: Callable[[], AbstractContextManager[None]] | None = None) -> None:
        self.parts: list[float] = []
        self.value: float | None = None
        self._quiet = quiet or contextlib.nullcontext

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.LOSS and ctx.loss is not None:
            with self._quiet():
                self.parts.append(float(ctx.loss.detach()))

    def step_ended(self, ctx: StepContext) -> None:
        if self.parts:
            self.value = ctx.step_loss(self.parts)

    def step_aborted(self, ctx: StepContext) -> None:
        self.step_ended(ctx)


__all__ = [
    "EXACT",
    "NOT_REPRODUCED",
    "VALUES_DIFFER",
    "Reproduction",
    "StepLoss",
    "Word",
    "mean_losses",
    "reproduction",
]
