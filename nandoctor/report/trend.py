"""A signal's recent trend, fitted on a log scale, and where it crosses a limit.

Growth that ends in an overflow is multiplicative (a weight grows by a share of itself
each update), so the fit is a straight line through ln(value) over the step: its slope
is the growth a step, and the step where the line reaches ln(limit) is when the signal
would cross it. Plain numbers, no torch::

    >>> g = growth([(0, 100.0), (1, 200.0), (2, 400.0)], limit=3200.0)
    >>> round(g.rate, 3), round(g.eta, 3), round(g.r2, 3)
    (2.0, 3.0, 1.0)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """A least-squares line through (x, y): y = intercept + slope * x, and its R^2 (the
    share of y's variance it explains; 1 for a perfect fit, 0 for a flat one)."""

    slope: float
    intercept: float
    r2: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(frozen=True)
class Growth:
    """A positive signal's trend: `rate` its factor a step (1.05: 5% a step), `eta` the
    steps from its last point until the fitted line reaches the limit, over `points`
    values spanning `span` steps."""

    rate: float
    eta: float
    r2: float
    points: int
    span: int
    last: float  # the fitted value at the last point
    recent: float  # the factor a step over the later half of the points alone

    @property
    def steadiness(self) -> float:
        """The later half's growth over the whole's, on a log scale: 1 for a steady
        exponential, above 1 accelerating, below 1 levelling off (a warmup ending, a
        model settling), 0 or less for a later half that no longer grows."""
        return math.log(self.recent) / math.log(self.rate)


def line(xs: Sequence[float], ys: Sequence[float]) -> Line | None:
    """The least-squares line; None for fewer than 3 points or one x."""
    if len(xs) < 3:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    syy = sum((y - my) ** 2 for y in ys)
    slope = sxy / sxx
    r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 0.0
    return Line(slope, my - slope * mx, r2)


def growth(points: Sequence[tuple[int, float]], limit: float) -> Growth | None:
    """The log-scale trend of (step, value) points towards `limit`; None when fewer than 3
    are finite and positive, or the fit does not rise."""
    kept = [(s, v) for s, v in points if v > 0 and math.isfinite(v)]
    fit = line([s for s, _ in kept], [math.log(v) for _, v in kept]) if kept else None
    if fit is None or fit.slope <= 0:
        return None
    last = kept[-1][0]
    now = fit.at(last)
    eta = (math.log(limit) - now) / fit.slope
    later = kept[len(kept) // 2 :]
    half = line([s for s, _ in later], [math.log(v) for _, v in later])
    recent = math.exp(half.slope) if half is not None else math.exp(fit.slope)
    span = last - kept[0][0]
    return Growth(math.exp(fit.slope), eta, fit.r2, len(kept), span, math.exp(now), recent)


__all__ = ["Growth", "Line", "growth", "line"]
