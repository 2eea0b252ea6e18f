"""The forecast's rules: each one a signal's recent values, its limit, and a sentence.

A rule reads one signal's recent points (step, value) and returns a `Claim` when their
trend, fitted on a log scale (`report.trend.growth`), reaches the limit within the
horizon, confidently enough (`Bar`); else None. Like Megatron's validation calls (a
value, a rejection function, a message), each rule is small and says why it fired.

    metric           limit                                        cause
    activation_peak  65504 in float16; 1.8e19 in float32 and      fp16-overflow (or float32-)
                     bfloat16, where its square overflows
    attention_logit  the logits' dtype's largest value            fp16-overflow (or float32-)
    softmax_spread   where a probability is 0 (17.3 in float16),  log-of-softmax
                     of a softmax whose output a log takes
    update_ratio     1: an update as large as the weights         learning-rate-too-high
    grad_norm        1.8e19: its float32 square overflows         exploding-gradients
    loss             float32's largest value, with its z-score    learning-rate-too-high
                     above ZClip's 2.5
    loss_scale       the collapse: skips in a row, or scale 1     grad-scaler-collapse

The bars were calibrated on the corpus of `benchmarks/forecast.py` (docs/forecast.md):
early enough on runs that fail by growth, never on the healthy ones (warmup, a cosine
schedule, a plateau, a GradScaler's calibration skips).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nandoctor.report.signals import (
    ACTIVATION_PEAK,
    ATTENTION_LOGIT,
    GRAD_NORM,
    LOSS,
    SOFTMAX_SPREAD,
    UPDATE_RATIO,
    Site,
)
from nandoctor.report.trend import Growth, growth

Points = Sequence[tuple[int, float]]


@dataclass(frozen=True)
class Claim:
    """What a rule saw: the cause coming, the value now, the limit, in how many steps."""

    kind: str
    value: float
    limit: float
    eta: int
    confidence: float
    why: str


@dataclass(frozen=True)
class Bar:
    """How sure a trend must be to be a forecast: at least `points` values, a fit that
    explains `r2` of their variance, a growth of at least `rate` a step, a crossing within
    `horizon` steps and within `reach` times the steps the points span (no farther out
    than the trend was seen for), a value at least `floor` of the way to the limit on a
    log scale (ln value / ln limit, for values above 1), and growth that is not levelling
    off (`steady`: the later half's growth at least that share of the whole's)."""

    points: int = 12
    r2: float = 0.85
    rate: float = 1.02
    horizon: int = 100
    reach: float = 2.0
    floor: float = 0.0
    steady: float = 0.7


def crossing(points: Points, limit: float, bar: Bar) -> Growth | None:
    """The trend of `points`, when it reaches `limit` within `bar`; None otherwise."""
    g = growth(points, limit)
    if g is None or g.points < bar.points or g.r2 < bar.r2 or g.rate < bar.rate:
        return None
    if g.steadiness < bar.steady:
        return None
    if g.eta > bar.horizon or g.eta > bar.reach * max(g.span, 1):
        return None
    if bar.floor and (g.last <= 1 or math.log(g.last) < bar.floor * math.log(limit)):
        return None
    return g


def confidence(g: Growth, bar: Bar) -> float:
    """0.3 to 0.9: higher for a cleaner fit and a nearer crossing."""
    near = 1 - max(0.0, g.eta) / bar.horizon
    return round(min(0.9, max(0.3, 0.25 + 0.4 * g.r2 + 0.25 * near)), 2)


def _claim(kind: str, site_limit: float, g: Growth, bar: Bar, why: str, value: float) -> Claim:
    return Claim(kind, value, site_limit, max(1, round(g.eta)), confidence(g, bar), why)


def overflow_kind(dtype: str) -> str:
    return "fp16-overflow" if dtype == "float16" else "float32-overflow"


def _grew(g: Growth, what: str) -> str:
    return f"{what} grew {g.rate:.3g}x a step over the last {g.span + 1} steps"


# -- the rules ---------------------------------------------------------------------------------
PEAK = Bar(floor=0.5)


def activation_peak(points: Points, site: Site) -> Claim | None:
    """A module's largest |output| growing towards its dtype's largest value."""
    g = crossing(points, site.limit, PEAK)
    if g is None:
        return None
    why = _grew(g, "its largest |output|")
    return _claim(overflow_kind(site.dtype), site.limit, g, PEAK, why, points[-1][1])


def attention_logit(points: Points, site: Site) -> Claim | None:
    """An attention's largest logit growing towards its dtype's largest value."""
    g = crossing(points, site.limit, PEAK)
    if g is None:
        return None
    why = _grew(g, "its largest attention logit")
    return _claim(overflow_kind(site.dtype), site.limit, g, PEAK, why, points[-1][1])


SPREAD = Bar(points=8, r2=0.8, rate=1.01, horizon=60, reach=3.0)


def softmax_spread(points: Points, site: Site) -> Claim | None:
    """A logged softmax's widest row spreading towards the point where its smallest
    probability rounds to 0 (and the log of it is -inf)."""
    if not site.logged or points[-1][1] < site.limit / 3:
        return None
    g = crossing(points, site.limit, SPREAD)
    if g is None:
        return None
    why = (
        f"{_grew(g, 'the widest spread (max - min) of its input rows')}; past "
        f"{site.limit:.3g} its smallest probability is 0 in {site.dtype}, and the log "
        "of it -inf"
    )
    return _claim("log-of-softmax", site.limit, g, SPREAD, why, points[-1][1])


UPDATE = Bar(points=12, r2=0.85, rate=1.03, horizon=60, reach=2.0)


def update_ratio(points: Points, site: Site) -> Claim | None:
    """A parameter group's update-to-weight ratio growing towards 1 (healthy: ~1e-3)."""
    if points[-1][1] < 0.1:  # NB: below, a momentum's or a warmup's first steps grow it too
        return None
    g = crossing(points, site.limit, UPDATE)
    if g is None:
        return None
    group = (site.module or "").replace("param_groups.", "parameter group ")
    what = f"the update-to-weight ratio |dw|/|w| of {group}"
    why = f"{_grew(g, what)} (healthy runs stay near 1e-3)"
    return _claim("learning-rate-too-high", site.limit, g, UPDATE, why, points[-1][1])


GRADS = Bar(points=12, r2=0.9, rate=1.1, horizon=100, reach=3.0, floor=0.1)


def grad_norm(points: Points, site: Site) -> Claim | None:
    """The gradient norm growing exponentially towards its dtype's largest value."""
    g = crossing(points, site.limit, GRADS)
    if g is None:
        return None
    why = f"{_grew(g, 'the gradient norm')}, with no clipping to stop it"
    return _claim("exploding-gradients", site.limit, g, GRADS, why, points[-1][1])


LOSS_BAR = Bar(points=12, r2=0.9, rate=1.1, horizon=100, reach=3.0)


def loss(points: Points, site: Site) -> Claim | None:
    """The loss climbing exponentially towards its dtype's largest value (the forecaster
    asks only while its z-score stays above ZClip's threshold): the updates diverge."""
    g = crossing(points, site.limit, LOSS_BAR)
    if g is None:
        return None
    why = f"{_grew(g, 'the loss')}, far above its own recent level: the updates diverge"
    return _claim("learning-rate-too-high", site.limit, g, LOSS_BAR, why, points[-1][1])


SIGNAL_RULES: dict[str, Callable[[Points, Site], Claim | None]] = {
    LOSS: loss,
    ACTIVATION_PEAK: activation_peak,
    ATTENTION_LOGIT: attention_logit,
    SOFTMAX_SPREAD: softmax_spread,
    UPDATE_RATIO: update_ratio,
    GRAD_NORM: grad_norm,
}

# -- the GradScaler ------------------------------------------------------------------------------
SKIP_WINDOW = 32  # the recent steps whose skips count
MIN_SKIPS = 6  # at least this many skips among them, after the first streak
MAX_STREAK = 10  # the sentinel's collapse: skips in a row (runtime.judge.MAX_SKIP_STREAK)
SCALE_HORIZON = 60


def loss_scale(
    recent: Sequence[tuple[int, float, bool]], min_scale: float, calibrated: bool
) -> Claim | None:
    """Skips bunching up after the scale's first calibration, as many or more in the later
    half of the window as in the earlier (a calibration spread over the first steps thins
    out): at their rate, each halving the scale, when does it reach `min_scale`, or the
    streak the sentinel calls a collapse? `recent`: (step, scale, skipped) of the last
    `SKIP_WINDOW` steps."""
    skips = [(s, scale) for s, scale, skipped in recent if skipped]
    if not calibrated or len(skips) < MIN_SKIPS or len(recent) < SKIP_WINDOW // 2:
        return None
    first, last = recent[0][1], recent[-1][1]
    if not last < first:  # NB: the scale grew back: skips it recovers from are benign
        return None
    middle = recent[len(recent) // 2][0]
    if sum(s >= middle for s, _ in skips) < sum(s < middle for s, _ in skips):
        return None  # NB: fewer and fewer: a calibration spread over the first steps
    later = [skipped for s, _, skipped in recent if s >= middle]
    rate = sum(later) / len(later)  # NB: the later half's: the skips' pace now
    halvings = math.log2(last / min_scale) if last > min_scale else 0.0
    streak = _streak(recent)  # NB: a long streak may end in the sentinel's collapse first
    eta = min(halvings / rate, MAX_STREAK - streak if streak >= MAX_STREAK // 2 else math.inf)
    if eta > SCALE_HORIZON:
        return None
    why = (
        f"the GradScaler skipped {len(skips)} of the last {len(recent)} steps after its "
        f"calibration, its scale falling from {first:g} to {last:g}; at one skip in "
        f"{1 / rate:.3g} steps it reaches {min_scale:g} in about {max(1, round(eta))}"
    )
    conf = round(min(0.9, 0.4 + 0.5 * rate), 2)
    return Claim("grad-scaler-collapse", last, min_scale, max(1, round(eta)), conf, why)


def _streak(recent: Sequence[tuple[int, float, bool]]) -> int:
    n = 0
    for _, _, skipped in reversed(recent):
        if not skipped:
            break
        n += 1
    return n


__all__ = ["SIGNAL_RULES", "Bar", "Claim", "crossing", "loss_scale", "overflow_kind"]
