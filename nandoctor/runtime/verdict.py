"""The sentinel's judgement of one step, as data: what it read (`Reading`) and what the
judge made of it (`Verdict`, whose `outcome` is a `StepOutcome`).

A verdict, as `watch` writes a watched process's failure (JSON, `dataclasses.asdict`):

    {"reading": {"step": 12, "grads": true, "scale": 8.0, ...}, "outcome": "collapsed",
     "step": 3, "phase": "backward", "streak_start": null, "unchecked": true,
     "why": "the GradScaler skipped 10 steps in a row from step 3, the last at loss scale 8"}

The rules that make one are `runtime.judge`'s; the probe that reads a step is
`runtime.sentinel`'s. Engines, reports and causes read verdicts and import this module
alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from nandoctor.runtime.probe import Phase

# Why the GradScaler skipped a step (`Verdict.skip_reason`, the event's `reason`)
OVERFLOW = "overflow"  # the gradients are finite at loss scale 1: the scale overflowed
UNCHECKED = "unchecked"  # the driver could not recheck the step (a loop it cannot re-run)


class StepOutcome(str, Enum):
    """How the judge found one step (`runtime.judge.Judge`).

    Step after step, the judge keeps one thing: the current streak of GradScaler skips.

        FINITE ──a skip──► SKIPPED_OVERFLOW or SKIPPED_UNCHECKED ──a finite step──► FINITE
                               │ (the skip rechecked at loss scale 1: finite, or unchecked)
                               ├──non-finite at loss scale 1 too──► HIDDEN (its own step)
                               └──the streak too long, the scale too small──► COLLAPSED
                                                                  (the streak's first step)
        any step ──a non-finite loss or weights, gradients with no scaler──► FAILED

    FAILED, HIDDEN and COLLAPSED are failures: the run's first ends it. A replay may then
    move one a step back, to the update that broke the weights it met
    (`Verdict.blamed_on_update`): a collapse becomes a plain FAILED there.
    """

    FINITE = "finite"  # every value the sentinel reads finite: the step counts
    SKIPPED_OVERFLOW = "skipped-overflow"  # skipped; finite at loss scale 1 (an overflow)
    SKIPPED_UNCHECKED = "skipped-unchecked"  # skipped; the driver could not recheck it
    FAILED = "failed"  # a loss, gradients or weights went non-finite
    HIDDEN = "hidden"  # the scaler skipped it, but it is non-finite at loss scale 1 too
    COLLAPSED = "collapsed"  # skips in a row until the GradScaler's scale collapsed

    @property
    def failed(self) -> bool:
        return self in _FAILURES

    @property
    def skipped(self) -> bool:
        return self in _SKIPS


_FAILURES = frozenset({StepOutcome.FAILED, StepOutcome.HIDDEN, StepOutcome.COLLAPSED})
_SKIPS = frozenset({StepOutcome.SKIPPED_OVERFLOW, StepOutcome.SKIPPED_UNCHECKED})
_SKIP_REASONS = {StepOutcome.SKIPPED_OVERFLOW: OVERFLOW, StepOutcome.SKIPPED_UNCHECKED: UNCHECKED}


@dataclass(slots=True)
class Reading:
    """What the sentinel saw in one step, on the host.

    NB: not frozen (treat it as if it were): one is made every step, and a frozen
    dataclass's `__init__` (a call per field) costs five times a plain one's."""

    step: int
    params_before: bool
    input: bool
    forward: bool
    loss_bad: bool
    grads: bool
    params: bool
    loss: float
    grad_norm: float
    scale: float | None
    origin_ranks: tuple[int, ...] = ()  # ranks that went non-finite on their own
    inherited_ranks: tuple[int, ...] = ()  # ranks that only got it through the all-reduce
    aborted: bool = False  # the step raised before it ended (`Sentinel.step_aborted`)
    # what a rider carried with the step's read (`Sentinel.carry`): its layout, the values
    carried: tuple[Any, list[float]] | None = None


@dataclass(slots=True)
class Verdict:
    """The judgement of one step: its outcome and, for a failure, the step and phase it
    names. NB: not frozen, for the reason `Reading` gives; a verdict that learns more
    (a replay, a recheck) is a new one (`dataclasses.replace`)."""

    reading: Reading
    outcome: StepOutcome = StepOutcome.FINITE
    step: int | None = None  # a failure's first bad step; a collapse's is its streak's first
    phase: Phase | None = None  # a failure's phase
    streak_start: int | None = None  # a skip's: the first step of the current streak
    # COLLAPSED: the streak's last skip could not be rechecked at loss scale 1 (a hooked
    # loop): a NaN the scaler hid at each skip collapses the scale as an overflow does
    unchecked: bool = False
    why: str = ""
    # failed in INPUT: the step's batches (one per micro-batch) as the step saw them, so a
    # report without a replay still names the batch tensor that held the NaN
    batches: list[object] = field(default_factory=list)
    # the same, described where the batches cannot travel (a watched process's verdict,
    # written as JSON for `watch`): the bad tensor's name, value, dtype, shape and count
    batch_named: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return self.outcome.failed

    @property
    def skipped(self) -> bool:
        return self.outcome.skipped

    @property
    def hidden(self) -> bool:
        """A failure the scaler hid: it skipped the step, but its gradients are
        non-finite at loss scale 1 too."""
        return self.outcome is StepOutcome.HIDDEN

    @property
    def collapsed(self) -> bool:
        """A GradScaler's scale collapsed: overflow skips repeated (`step` is then the
        streak's first step, and the reading's scale the one the streak fell to)."""
        return self.outcome is StepOutcome.COLLAPSED

    @property
    def collapsed_unchecked(self) -> bool:
        """A collapse whose skips no rerun rechecked at loss scale 1 (a hooked loop)."""
        return self.outcome is StepOutcome.COLLAPSED and self.unchecked

    @property
    def skip_reason(self) -> str | None:
        """Why the GradScaler skipped the step (a collapse: its last skip): OVERFLOW or
        UNCHECKED; None for a step it did not skip."""
        if self.outcome is StepOutcome.COLLAPSED:
            return UNCHECKED if self.unchecked else OVERFLOW
        return _SKIP_REASONS.get(self.outcome)

    @property
    def replay_scale(self) -> float | None:
        """The loss scale a replay of this failure runs at: 1 for a failure the scaler hid
        (no overflow of the scale can then hide or fake the origin), the scale a collapse
        fell to, or None (the run's own)."""
        if self.hidden:
            return 1.0
        return self.reading.scale if self.collapsed else None

    def blamed_on_update(self, why: str) -> Verdict:
        """This failure moved one step back, to the optimizer's update that broke the
        weights its step met (its replay found them broken before it): a collapse no
        longer (what failed is that update, not the streak); one the scaler hid, still."""
        if self.step is None:
            raise ValueError("a verdict that did not fail has no step to move back")
        collapsed = self.outcome is StepOutcome.COLLAPSED
        outcome = StepOutcome.FAILED if collapsed else self.outcome
        step, phase = self.step - 1, Phase.OPTIMIZER
        return dataclasses.replace(
            self, outcome=outcome, step=step, phase=phase, unchecked=False, why=why
        )


__all__ = ["OVERFLOW", "UNCHECKED", "Reading", "StepOutcome", "Verdict"]
