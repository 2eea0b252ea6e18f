"""The forecaster: each step's signals in, the forecasts that fire out, on the host.

Every driver records its verdicts through one place (`runtime.record.Recorder`), which
hands each clean step here: its loss, gradient norm and loss scale (the sentinel's
reading), whether the GradScaler skipped it, and the device signals it carried
(`report.signals.Layout`). The forecaster keeps the last `WINDOW` values of each signal,
asks the rules of `report.forecast_rules` about those still growing, and returns a
`Forecast` the first time one fires for a cause, module and metric::

    forecaster = Forecaster()
    for each step:  new = forecaster.observe(step, loss, grad_norm, scale, skipped, signals)
    forecaster.forecasts     # every one fired so far, best first

Plain numbers: deterministic, and the same whoever drove the steps.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence

from nandoctor.report.forecast import Forecast, best_first
from nandoctor.report.forecast_rules import SIGNAL_RULES, SKIP_WINDOW, Claim, loss_scale
from nandoctor.report.limits import DTYPE_MAX, overflow_limit
from nandoctor.report.signals import (
    GRAD_NORM,
    LOSS,
    LOSS_SCALE,
    LOSS_Z,
    SKIP_RATE,
    UPDATE_RATIO,
    Curves,
    Layout,
    Site,
)

WINDOW = 24  # values kept per signal: the trend is fitted over them
LOOKBACK = 8  # values a signal needs before it is asked about (and a new high then)
ASK_EVERY = 3  # steps between two fits of one signal (a fit costs the host ~50 us)
Z_ALPHA = 0.97  # ZClip's EMA of the loss: about its last 33 steps weigh most
Z_WARMUP = 25  # steps that only feed the EMA (ZClip's warmup)
Z_HIGH = 2.5  # ZClip's threshold: a loss this many deviations above its recent mean
CURVE_FRACTIONS = ("activation_peak", "softmax_spread", "attention_logit")
MODULE_METRICS = CURVE_FRACTIONS  # NB: measured in a module (or the loss: None); the others
# are the run's (an update ratio's group is in its why)


SQRT_FLOAT32_MAX = overflow_limit("float32")  # a norm past it overflows its float32 square


class LossZ:
    """The loss's z-score against its own exponential moving mean and variance."""

    def __init__(self) -> None:
        self.mean: float | None = None
        self.var = 0.0
        self.seen = 0

    def update(self, loss: float) -> float | None:
        """This loss's z-score (None during the warmup), then the averages move on."""
        if not math.isfinite(loss):
            return None
        z = None
        if self.mean is not None and self.seen >= Z_WARMUP:
            z = (loss - self.mean) / max(math.sqrt(self.var), 1e-12 + abs(self.mean) * 1e-6)
        if self.mean is None:
            self.mean = loss
        else:
            delta = loss - self.mean
            self.mean += (1 - Z_ALPHA) * delta
            self.var = Z_ALPHA * (self.var + (1 - Z_ALPHA) * delta * delta)
        self.seen += 1
        return z


class Forecaster:
    """`grad_limit`: the gradients' dtype's largest value; `min_scale`: the loss scale the
    sentinel calls collapsed."""

    def __init__(self, grad_limit: float = SQRT_FLOAT32_MAX, min_scale: float = 1.0) -> None:
        self.grad_site = Site(GRAD_NORM, None, None, "float32", grad_limit)
        self.loss_site = Site(LOSS, None, None, "float32", DTYPE_MAX["float32"])
        self.min_scale = min_scale
        self.curves = Curves()
        self._series: dict[Site, deque[tuple[int, float]]] = {}
        self._asked: dict[Site, int] = {}  # the step each signal was last fitted at
        self._scales: deque[tuple[int, float, bool]] = deque(maxlen=SKIP_WINDOW)
        self._calibrated = False  # the scale's first streak of skips is over
        self._skipping = False  # a skip is among the recent steps
        self._z = LossZ()
        self._high_z: deque[bool] = deque(maxlen=WINDOW)
        self._fired: dict[tuple[str, str], Forecast] = {}

    @property
    def forecasts(self) -> list[Forecast]:
        return best_first(list(self._fired.values()))

    def observe(
        self,
        step: int,
        loss: float,
        grad_norm: float,
        scale: float | None,
        skipped: bool,
        signals: tuple[Layout, Sequence[float]] | None = None,
    ) -> list[Forecast]:
        """One clean (or skipped) step; the forecasts that fired for the first time."""
        pairs = signals[0].read(signals[1]) if signals is not None else []
        if not skipped and math.isfinite(grad_norm) and grad_norm > 0:
            pairs.append((self.grad_site, grad_norm))
        z = self._z.update(loss)
        self._high_z.append(z is not None and z > Z_HIGH)
        if sum(itertools.islice(reversed(self._high_z), LOOKBACK)) >= LOOKBACK // 2:
            pairs.append((self.loss_site, loss))
        asked = [self._keep(step, site, value) for site, value in pairs]
        claims = [
            (s, SIGNAL_RULES[s.metric](list(self._series[s]), s)) for s in asked if s is not None
        ]
        scaler = self._scaler(step, scale, skipped)
        self._curve(step, pairs, z)
        found = [(s, c) for s, c in claims if c is not None]
        if scaler is not None:
            found.append((Site(LOSS_SCALE, None, None, "float32", self.min_scale), scaler))
        return [f for f in (self._fire(step, site, claim) for site, claim in found) if f]

    def _keep(self, step: int, site: Site, value: float) -> Site | None:
        """Add the value; the site, if it is the highest its window has held (a signal
        heading for its limit keeps setting new highs; the others need no fit)."""
        if not math.isfinite(value) or value <= 0:
            return None
        series = self._series.get(site)
        if series is None:
            series = self._series[site] = deque(maxlen=WINDOW)
        high = max((v for _, v in series), default=math.inf)
        series.append((step, value))
        if len(series) < LOOKBACK or value <= high or site.metric not in SIGNAL_RULES:
            return None
        if step - self._asked.get(site, -ASK_EVERY) < ASK_EVERY:
            return None
        self._asked[site] = step
        return site

    def _scaler(self, step: int, scale: float | None, skipped: bool) -> Claim | None:
        if scale is None:
            return None
        if not skipped and not self._calibrated:
            self._calibrated = True  # NB: the first clean step: the first streak is over,
            self._scales.clear()  # and its skips are the scale's calibration, not a trend
        self._scales.append((step, scale, skipped))
        if skipped or self._skipping:  # NB: the rate moves only while skips are in the window
            rate = sum(s for _, _, s in self._scales) / len(self._scales)
            self._skipping = rate > 0
            self.curves.add(SKIP_RATE, step, rate)
        return loss_scale(list(self._scales), self.min_scale, self._calibrated)

    def _fire(self, step: int, site: Site, claim: Claim) -> Forecast | None:
        module = site.module if site.metric in MODULE_METRICS else None
        key = (claim.kind, site.metric)  # NB: the first module to fire speaks for the others
        if key in self._fired:
            return None
        boost = 0.05 if any(self._high_z) else 0.0  # NB: the loss already reacts
        forecast = Forecast(
            step=step,
            kind=claim.kind,
            module=module,
            op=site.op,
            metric=site.metric,
            value=claim.value,
            limit=claim.limit,
            eta_steps=claim.eta,
            confidence=round(min(0.95, claim.confidence + boost), 2),
            why=claim.why,
        )
        self._fired[key] = forecast
        return forecast

    def _curve(self, step: int, pairs: list[tuple[Site, float]], z: float | None) -> None:
        """The step's point of each curve (`report.signals.Curves`)."""
        worst: dict[str, float] = {}
        for site, value in pairs:
            if site.metric in CURVE_FRACTIONS and math.isfinite(value):
                worst[site.metric] = max(worst.get(site.metric, 0.0), value / site.limit)
            elif site.metric == UPDATE_RATIO:
                self.curves.add(f"{UPDATE_RATIO}/{site.module}", step, value)
        for metric, fraction in worst.items():
            self.curves.add(metric, step, fraction)
        grads = self._series.get(self.grad_site)
        if grads is not None and len(grads) >= 2 and grads[-1][0] == step:
            self.curves.add("grad_norm_growth", step, grads[-1][1] / grads[-2][1])
        if z is not None:
            self.curves.add(LOSS_Z, step, z)


__all__ = ["Forecaster", "LossZ"]
