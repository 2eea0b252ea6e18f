"""The learning check of a what-if replay: a fix that keeps the run finite but stops it
learning is no fix. A guard that clamps the one op can hide a run that diverges (its loss
climbs to 1e9 and stays finite), and zeroing a checkpoint's NaN weights can leave a network
that cannot learn; both get past the failing step, and neither is verified.

Losses are read as means over windows, a quarter of the check (at least 3 steps) at each
end, since single batches differ a lot. The check has **stopped learning** when either

- its loss fell by less than `MIN_GAIN` (1%) of where it started, from the first window to
  the last: flat or diverging (a network whose every weight was zeroed, a clamp that keeps
  a diverging run finite). Where it started is its first loss when the first window's mean
  is more than `RISEN` (2x) that: a run that blew up at once and came back down to chance
  (a learning rate still too high, that leaves a dead network) gained nothing, though its
  loss "fell" from the blow-up; or
- it ended more than `MARGIN` (50%) above the loss the original run had reached at its last
  finite steps (the mean of up to `REFERENCE_STEPS` of them, before the failing step).

Both bounds are loose on purpose: a fix that only slows learning (a 10x smaller learning
rate) still counts, since the check runs a horizon, not a whole training run; what they
catch is a run that does not learn at all, or ends far behind where it was.

A check **resumed** from a snapshot late in the run starts where the loss is nearly flat
already: a few dozen steps there need not gain 1%. It is judged by the second bound alone
(where the original's losses give one): a fix that lets the run diverge or collapse ends
far above where the original was.

Plain numbers in, a verdict out: no torch, no runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from nandoctor.causes.words import num

MARGIN = 0.5  # the end may be at most this much above the original's last finite loss
MIN_GAIN = 0.01  # a check that learns ends at least this fraction below its start
REFERENCE_STEPS = 5  # how many of the original's last finite losses make the reference
MIN_WINDOW = 3
# a first window whose mean is this many times the first loss blew up: the gain counts
# from the first loss (one batch's, but a run's first losses sit at chance together)
RISEN = 2.0


@dataclass(frozen=True)
class Learning:
    """What the check's losses say: did it learn, from what to what, and why not."""

    learned: bool
    start: float | None = None  # mean loss of the check's first window
    end: float | None = None  # ... and of its last
    why: str = ""  # why it did not learn, as a clause


def reference_loss(losses: Sequence[float]) -> float | None:
    """The original run's loss at its last finite steps (those before the failing step):
    the mean of the last few finite ones; None when it had none."""
    finite = [x for x in losses if math.isfinite(x)]
    tail = finite[-REFERENCE_STEPS:]
    return statistics.fmean(tail) if tail else None


def learning_of(
    losses: Sequence[float], reference: float | None, *, resumed: bool = False
) -> Learning:
    """Judge a finite check's losses (in step order) against the original's `reference`
    (`resumed`: the check started from a snapshot, not from the run's start)."""
    finite = [x for x in losses if math.isfinite(x)]
    k = max(MIN_WINDOW, len(finite) // 4)
    if len(finite) < 2 * k:
        return Learning(True)  # too short to tell: the finiteness verdict stands alone
    start, end = statistics.fmean(finite[:k]), statistics.fmean(finite[-k:])
    climbed = ""
    if finite[0] > 0 and start > RISEN * finite[0]:
        # NB: a run that blew up in its first window and came back down (a dead network at
        # chance): what it gained counts from its first loss, not from the blow-up
        start, climbed = finite[0], f" (after a climb to {num(max(finite))})"
    if start - end <= MIN_GAIN * abs(start) and not (resumed and reference is not None):
        if end >= start:
            why = f"its loss went from {num(start)} up to {num(end)}{climbed}"
        else:
            gain = (start - end) / abs(start)
            why = f"its loss fell by only {gain:.1%}, from {num(start)} to {num(end)}{climbed}"
        return Learning(False, start, end, why)
    if reference is not None and end - reference > MARGIN * abs(reference):
        why = (
            f"its loss ended at {num(end)}, more than {MARGIN:.0%} above the {num(reference)} "
            "the original run had reached before failing"
        )
        return Learning(False, start, end, why)
    return Learning(True, start, end)
