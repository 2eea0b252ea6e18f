"""What the telemetry says about the run before its failure: did the gradient norm grow,
did the loss climb back up, which diverged first, how often did the GradScaler skip.
Plain numbers from the report's telemetry; non-finite values are left out.

    >>> t = trends_of(Telemetry(step=[0, 1, 2, 3], loss=[2.0, 1.0, 3.0, float("nan")],
    ...     grad_norm=[1.0, 1.0, 8.0, float("nan")], scale=[None] * 4))
    >>> (t.grad_growth, t.loss_rise)
    (8.0, 3.0)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from nandoctor.report.telemetry import Event, Telemetry

EARLY_FRACTION = 0.2  # the "early" window: the first fifth of the run...
LATE_FRACTION = 0.1  # ...and the "late" one: the last tenth before the failure
MIN_WINDOW = 3
GRAD_ONSET = 2.5  # "far above usual": this many times the median of the steps before
LOSS_ONSET = 2.0


@dataclass(frozen=True)
class Trends:
    steps: int  # steps with telemetry
    grad_early: float | None  # median gradient norm of the early window
    grad_late: float | None  # largest gradient norm of the late window
    loss_min: float | None
    loss_min_step: int | None
    loss_last: float | None  # the last finite loss before the failure
    loss_late_slope: float | None  # loss change per step over the late window
    skips: int
    longest_skip_streak: int
    grad_onset: int | None = None  # from this step on, the gradient norm stayed far above usual
    loss_onset: int | None = None  # from this step on, the loss stayed far above usual
    late_skips: int = 0  # GradScaler skips after the first streak (the scale's calibration)
    # the GradScaler's last streak of skips, up to the last step recorded (the step that
    # ended the run counts, whether its verdict is the collapse, a skip event too, or
    # another failure right after the streak), and the loss scale the telemetry shows at
    # the streak's first and last steps
    final_streak: int = 0
    final_streak_start: int | None = None
    final_scales: tuple[float | None, float | None] = (None, None)  # at its first, last step
    loss_first: float | None = None  # the first finite loss
    loss_peak: float | None = None  # the largest finite loss

    @property
    def grad_growth(self) -> float | None:
        if not self.grad_early or self.grad_late is None:
            return None
        return self.grad_late / self.grad_early

    @property
    def loss_rose(self) -> bool:
        """The loss went above twice its first value at some step (then maybe came back:
        a network that blew up and saturated at chance ends near its best loss)."""
        first, peak = self.loss_first, self.loss_peak
        return first is not None and peak is not None and first > 0 and peak > 2 * first

    @property
    def loss_rise(self) -> float | None:
        """How many times the last loss exceeds the best one (1.0: at its best)."""
        if not self.loss_min or self.loss_last is None or self.loss_min <= 0:
            return None
        return self.loss_last / self.loss_min


def trends_of(telemetry: Telemetry, events: list[Event] | None = None) -> Trends:
    skipped = sorted(e.step for e in events or [] if e.kind == "scaler-skip")
    grads = _finite(telemetry.step, telemetry.grad_norm)
    losses = _finite(telemetry.step, telemetry.loss)
    early, late = _windows(len(grads))
    best = min(losses, key=lambda p: p[1], default=None)
    _, late_losses = _windows(len(losses))
    streak, streak_start = _final_streak(telemetry.step, set(skipped))
    return Trends(
        steps=len(telemetry.step),
        grad_early=statistics.median(g for _, g in grads[:early]) if grads else None,
        grad_late=max(g for _, g in grads[-late:]) if grads else None,
        loss_min=best[1] if best else None,
        loss_min_step=best[0] if best else None,
        loss_last=losses[-1][1] if losses else None,
        loss_late_slope=_slope(losses[-late_losses:]) if len(losses) >= MIN_WINDOW else None,
        skips=len(skipped),
        longest_skip_streak=_longest_streak(skipped),
        grad_onset=onset(grads, GRAD_ONSET),
        loss_onset=onset(losses, LOSS_ONSET),
        late_skips=len(skipped) - _first_streak(skipped),
        final_streak=streak,
        final_streak_start=streak_start,
        final_scales=_scales_of(telemetry, streak_start) if streak else (None, None),
        loss_first=losses[0][1] if losses else None,
        loss_peak=max(v for _, v in losses) if losses else None,
    )


def onset(points: list[tuple[int, float]], factor: float) -> int | None:
    """The first step from which every value stays above `factor` x the median before it:
    when a divergence began, as opposed to a spike the run recovered from."""
    for i in range(MIN_WINDOW, len(points)):
        usual = statistics.median(v for _, v in points[:i])
        if usual > 0 and all(v > factor * usual for _, v in points[i:]):
            return points[i][0]
    return None


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


def _final_streak(steps: list[int], skipped: set[int]) -> tuple[int, int | None]:
    """(length, first step) of the streak of skips that runs into the last recorded step,
    counted from the events, so that a sentence about it quotes what the telemetry shows."""
    if not steps or not (steps[-1] in skipped or steps[-1] - 1 in skipped):
        return 0, None
    start = steps[-1] if steps[-1] in skipped else steps[-1] - 1
    while start - 1 in skipped:
        start -= 1
    return steps[-1] - start + 1, start


def _scales_of(telemetry: Telemetry, start: int | None) -> tuple[float | None, float | None]:
    """The loss scale the telemetry shows at step `start` and at the last step."""
    scales = dict(zip(telemetry.step, telemetry.scale, strict=False))
    last = scales.get(telemetry.step[-1]) if telemetry.step else None
    return scales.get(start) if start is not None else None, last


def _first_streak(steps: list[int]) -> int:
    """How many skips the first streak has (0 without skips)."""
    n = 1 if steps else 0
    while n < len(steps) and steps[n] == steps[n - 1] + 1:
        n += 1
    return n
