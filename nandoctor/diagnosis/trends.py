"""What the telemetry says about the run before its failure: did the gradient norm grow,
did the loss climb back up, how often did the GradScaler skip. Plain numbers, from the
report's telemetry; the failing step itself is left out (its values are non-finite).

    >>> t = trends_of(Telemetry(step=[0, 1, 2, 3], loss=[2.0, 1.0, 3.0, float("nan")],
    ...     grad_norm=[1.0, 1.0, 8.0, float("nan")], scale=[None] * 4))
    >>> (t.grad_growth, t.loss_rise)
    (8.0, 3.0)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from nandoctor.telemetry import Event, Telemetry

EARLY_FRACTION = 0.2  # the "early" window: the first fifth of the run...
LATE_FRACTION = 0.1  # ...and the "late" one: the last tenth before the failure
MIN_WINDOW = 3


@dataclass(frozen=True)
class Trends:
    steps: int  # clean steps with telemetry
    grad_early: float | None  # median gradient norm of the early window
    grad_late: float | None  # largest gradient norm of the late window
    loss_min: float | None
    loss_min_step: int | None
    loss_last: float | None  # the last finite loss before the failure
    loss_late_slope: float | None  # loss change per step over the late window
    skips: int
    longest_skip_streak: int

    @property
    def grad_growth(self) -> float | None:
        if not self.grad_early or self.grad_late is None:
            return None
        return self.grad_late / self.grad_early

    @property
    def loss_rise(self) -> float | None:
        """How many times the last loss exceeds the best one (1.0: at its best)."""
        if not self.loss_min or self.loss_last is None or self.loss_min <= 0:
            return None
        return self.loss_last / self.loss_min


def trends_of(telemetry: Telemetry, events: list[Event] | None = None) -> Trends:
    grads = _finite(telemetry.step, telemetry.grad_norm)
    losses = _finite(telemetry.step, telemetry.loss)
    early, late = _windows(len(grads))
    loss_min = min(losses, key=lambda p: p[1], default=None)
    _, late_losses = _windows(len(losses))
    return Trends(
        steps=len(telemetry.step),
        grad_early=statistics.median(g for _, g in grads[:early]) if grads else None,
        grad_late=max(g for _, g in grads[-late:]) if grads else None,
        loss_min=loss_min[1] if loss_min else None,
        loss_min_step=loss_min[0] if loss_min else None,
        loss_last=losses[-1][1] if losses else None,
        loss_late_slope=_slope(losses[-late_losses:]) if len(losses) >= MIN_WINDOW else None,
        skips=sum(e.kind == "scaler-skip" for e in events or []),
        longest_skip_streak=_longest_streak(
            sorted(e.step for e in events or [] if e.kind == "scaler-skip")
        ),
    )


def _finite(steps: list[int], values: list[float]) -> list[tuple[int, float]]:
    return [
        (s, v) for s, v in zip(steps, values, strict=False) if v is not None and math.isfinite(v)
    ]


def _windows(n: int) -> tuple[int, int]:
    early = max(MIN_WINDOW, int(n * EARLY_FRACTION))
    late = max(MIN_WINDOW, int(n * LATE_FRACTION))
    return min(early, n), min(late, n)


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value over step."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


def _longest_streak(steps: list[int]) -> int:
    longest = run = 0
    for i, s in enumerate(steps):
        run = run + 1 if i and s == steps[i - 1] + 1 else 1
        longest = max(longest, run)
    return longest
