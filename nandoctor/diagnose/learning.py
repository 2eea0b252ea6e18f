"""The learning check of a what-if replay: a fix that keeps the run finite but stops it
learning is no fix. A guard that clamps the one op can hide a run that diverges (its loss
climbs to 1e9 and stays finite), and zeroing a checkpoint's NaN weights can leave a network
that cannot learn; both get past the failing step, and neither is verified.

The check is measured in the original run's own units, never by a ratio of losses (a loss
near 0, or a negative one, a Gaussian's or a bound's, has no meaningful ratio): its
**progress**, how far its loss fell from its first losses (the mean of the first quarter
of its finite losses before the failing step, at least `MIN_WINDOW`) to where it had got
(the mean of its last `REFERENCE_STEPS`), and its **step-to-step noise**, how much one
batch's loss differs from the next one's beyond the trend (`noise_of`). The check's own
losses are read as means over windows, a quarter of the check (at least `MIN_WINDOW`
steps) at each end, since single batches differ a lot. It has **stopped learning** when

- it ended behind where the original had got (its steps before the failure, the same
  batches the check ran: the stream is the run's) by more than `MARGIN` (half) of the
  original's progress plus `NOISE` (2) times its noise: a fix that let the run diverge
  or collapse ends far behind; one that only slows learning (a 10x smaller learning
  rate) gives back less than half; a loss falling to 0.003 where the original had
  reached 0.001 from 1.84 gave back 0.1%; or
- its loss fell by less than `MIN_GAIN` (1%) of where it began, from the first window to
  the last: flat or diverging (a network whose every weight was zeroed). Where it began
  is the original's loss on the same steps, where the original ran them, else the
  check's first window, or its first loss when the window's mean is more than `RISEN`
  (2x) that (a run that blew up at once and came back down to chance, a learning rate
  still too high that leaves a dead network, gained nothing, though its loss "fell"
  from the blow-up). Not asked of a check **resumed** from a snapshot late in the run,
  where the loss is nearly flat already and a few dozen steps need not gain anything,
  when the original's losses give the first bound.

Without enough of the original's losses (`MIN_ORIGINAL`: a run that failed at its first
steps), the second bound alone judges. Both bounds are loose on purpose: the check runs
a horizon, not a training run; what they catch is a run that does not learn at all, or
ends far behind where it was.

Plain numbers in, a verdict out: no torch, no runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from nandoctor.causes.words import num

MARGIN = 0.5  # the end may give back at most this share of the original's progress...
NOISE = 2.0  # ...plus this many times its step-to-step noise
MIN_GAIN = 0.01  # a check that learns ends at least this fraction below where it began
REFERENCE_STEPS = 5  # how many of the original's last finite losses say where it had got
MIN_WINDOW = 3
MIN_ORIGINAL = 2 * MIN_WINDOW  # fewer of the original's losses measure no progress
# a first window whose mean is this many times the first loss blew up: the gain counts
# from the first loss (one batch's, but a run's first losses sit at chance together)
RISEN = 2.0
# NB: the median absolute second difference of iid noise of deviation s is
# 0.6745 * sqrt(6) * s (a second difference is x[i-1] - 2 x[i] + x[i+1])
_SECOND_DIFF_MAD = 0.6745 * math.sqrt(6)

Losses = Sequence[tuple[int, float]]  # (step, loss), in step order


@dataclass(frozen=True)
class Original:
    """The original run's yardstick: where its loss began and had got before failing,
    its progress between the two (<= 0: it made none), its step-to-step noise, and its
    losses by step."""

    first: float
    reached: float
    noise: float
    by_step: dict[int, float]

    @property
    def progress(self) -> float:
        return self.first - self.reached

    @classmethod
    def of(cls, losses: Losses) -> Original | None:
        """From the original's (step, loss) before the failing step; None when too few
        are finite to measure its progress."""
        finite = [(s, x) for s, x in losses if math.isfinite(x)]
        if len(finite) < MIN_ORIGINAL:
            return None
        values = [x for _, x in finite]
        k = max(MIN_WINDOW, len(values) // 4)
        first, reached = statistics.fmean(values[:k]), statistics.fmean(values[-REFERENCE_STEPS:])
        return cls(first, reached, noise_of(values), dict(finite))


def noise_of(values: Sequence[float]) -> float:
    """The step-to-step noise of a run's losses: their deviation beyond the trend, from the
    median of their second differences (robust: a blow-up or a few odd batches do not
    count, and a steady fall is no noise); 0 with fewer than 3 losses."""
    second = [abs(a - 2 * b + c) for a, b, c in zip(values, values[1:], values[2:], strict=False)]
    return statistics.median(second) / _SECOND_DIFF_MAD if second else 0.0


def reference_loss(losses: Losses) -> float | None:
    """Where the original run had got before failing: the mean of its last few finite
    losses; None when it had none."""
    finite = [x for _, x in losses if math.isfinite(x)]
    tail = finite[-REFERENCE_STEPS:]
    return statistics.fmean(tail) if tail else None


@dataclass(frozen=True)
class Learning:
    """What the check's losses say: did it learn, from what to what, and why not."""

    learned: bool
    start: float | None = None  # mean loss of the check's first window
    end: float | None = None  # ... and of its last
    why: str = ""  # why it did not learn, as a clause


def learning_of(check: Losses, original: Losses, *, resumed: bool = False) -> Learning:
    """Judge a finite check's (step, loss) against the original run's before its failing
    step (`resumed`: the check started from a snapshot, not from the run's start)."""
    finite = [(s, x) for s, x in check if math.isfinite(x)]
    k = max(MIN_WINDOW, len(finite) // 4)
    if len(finite) < 2 * k:
        return Learning(True)  # too short to tell: the finiteness verdict stands alone
    values = [x for _, x in finite]
    start, end = statistics.fmean(values[:k]), statistics.fmean(values[-k:])
    yardstick = Original.of(original)
    if not (resumed and yardstick is not None):
        stalled = _stalled(finite, k, end, yardstick)
        if stalled:
            return Learning(False, start, end, stalled)
    behind = _behind(end, yardstick) if yardstick is not None else ""
    return Learning(not behind, start, end, behind)


def _stalled(finite: Losses, k: int, end: float, original: Original | None) -> str:
    """Why the check gained less than `MIN_GAIN` of where it began, as a clause; "" when
    it gained more."""
    began, climbed = _began(finite[:k], original)
    if began - end > MIN_GAIN * abs(began):
        return ""
    climb = f" (after a climb to {num(max(x for _, x in finite))})" if climbed else ""
    if end >= began:
        return f"its loss went from {num(began)} up to {num(end)}{climb}"
    gain = (began - end) / abs(began)
    return f"its loss fell by only {gain:.1%}, from {num(began)} to {num(end)}{climb}"


def _behind(end: float, original: Original) -> str:
    """Why the check ended too far behind where the original had got, as a clause; ""
    when it did not."""
    allowed = MARGIN * max(original.progress, 0.0) + NOISE * original.noise
    behind = end - original.reached
    if behind <= allowed:
        return ""
    noise = f"twice its step-to-step noise ({num(original.noise)})"
    if original.progress > 0:
        bound = (
            f"more than half the original's progress ({num(original.first)} down to "
            f"{num(original.reached)}) plus {noise}"
        )
    else:
        bound = f"more than {noise}, the original having made no progress to measure by"
    return (
        f"its loss ended at {num(end)}, {num(behind)} above the {num(original.reached)} the "
        f"original run had reached before failing: {bound}"
    )


def _began(window: Losses, original: Original | None) -> tuple[float, bool]:
    """Where the check began, and whether it climbed first: the original's loss on the
    same steps where it ran them all; else the check's own first window, or its first
    loss when that window blew up."""
    values = [x for _, x in window]
    start = statistics.fmean(values)
    climbed = start > RISEN * values[0] > 0
    same = [original.by_step.get(s) for s, _ in window] if original is not None else [None]
    if all(x is not None for x in same):
        began = statistics.fmean(x for x in same if x is not None)
        return (min(began, values[0]) if climbed else began), climbed
    # NB: a run that blew up in its first window and came back down (a dead network at
    # chance): what it gained counts from its first loss, not from the blow-up
    return (values[0] if climbed else start), climbed
