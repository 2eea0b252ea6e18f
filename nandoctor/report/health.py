"""Numeric health: how a run behaved while it stayed finite, for CI gates and baselines.

Per module, the largest activation and gradient magnitudes over the run (and how much of
float16's 65504 they use); the gradient norm's percentiles; the GradScaler's skips; the
final loss. Measured with the headroom probe when a gate needs it, never on the plain fast
path. Plain data; `gate.check` compares two of them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from nandoctor.report.limits import FLOAT16_MAX
from nandoctor.report.telemetry import Event, Telemetry
from nandoctor.report.trends import trends_of

FINAL_WINDOW = 0.1  # the final loss is the mean over the last tenth of the steps (at least 5)


@dataclass(frozen=True)
class Headroom:
    """A module's peak activation and gradient, and how much of float16's range they use."""

    module: str
    type: str
    activation_absmax: float
    activation_step: int | None
    gradient_absmax: float | None = None
    gradient_step: int | None = None
    order: int = 0  # when its output was first seen: forward execution order
    params: int | None = None  # its own parameters' elements: tells a layer from another
    # the first step its output held a non-finite value, which the peaks leave out (an
    # output that overflowed float16 is inf: its finite peak can be 0)
    nonfinite_step: int | None = None

    @property
    def activation_fraction(self) -> float:
        return self.activation_absmax / FLOAT16_MAX

    @property
    def gradient_fraction(self) -> float | None:
        return None if self.gradient_absmax is None else self.gradient_absmax / FLOAT16_MAX

    @property
    def peak_fraction(self) -> float:
        return max(self.activation_fraction, self.gradient_fraction or 0.0)


@dataclass(frozen=True)
class ModuleHealth:
    module: str
    type: str
    activation_absmax: float
    gradient_absmax: float | None = None
    order: int = 0  # forward execution order: where a regression starts
    # its own parameters' elements (None: recorded before baselines kept them): a layer
    # inserted into an nn.Sequential takes an old one's path, rarely its size
    params: int | None = None

    def same_as(self, other: ModuleHealth) -> bool:
        """The same module of the same model: path, type and, where both know it, size."""
        sized = self.params is not None and other.params is not None
        return (self.module, self.type) == (other.module, other.type) and (
            not sized or self.params == other.params
        )


@dataclass(frozen=True)
class GradNorms:
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None


@dataclass
class Health:
    steps: int
    final_loss: float | None
    grad_norm: GradNorms
    scaler_skips: int
    longest_skip_streak: int
    headroom: float  # the largest module peak as a fraction of float16's 65504
    headroom_module: str | None
    modules: list[ModuleHealth] = field(default_factory=list)  # sorted by path: diff-friendly

    def counterpart(self, other: ModuleHealth) -> ModuleHealth | None:
        """This run's module that is `other` (`ModuleHealth.same_as`), if any."""
        return next((m for m in self.modules if m.same_as(other)), None)


def health_of(telemetry: Telemetry, events: list[Event], peaks: list[Headroom]) -> Health:
    grads = sorted(g for g in telemetry.grad_norm if g is not None and math.isfinite(g))
    trends = trends_of(telemetry, events)
    top = max(peaks, key=lambda h: h.peak_fraction, default=None)
    return Health(
        steps=len(telemetry.step),
        final_loss=_final_loss(telemetry.loss),
        grad_norm=GradNorms(
            p50=_percentile(grads, 50),
            p90=_percentile(grads, 90),
            p99=_percentile(grads, 99),
            max=grads[-1] if grads else None,
        ),
        scaler_skips=trends.skips,
        longest_skip_streak=trends.longest_skip_streak,
        headroom=top.peak_fraction if top else 0.0,
        headroom_module=top.module if top else None,
        modules=sorted(
            (
                ModuleHealth(
                    h.module, h.type, h.activation_absmax, h.gradient_absmax, h.order, h.params
                )
                for h in peaks
            ),
            key=lambda m: m.module,
        ),
    )


def _final_loss(losses: list[float]) -> float | None:
    finite = [v for v in losses if v is not None and math.isfinite(v)]
    if not finite:
        return None
    window = max(5, int(len(finite) * FINAL_WINDOW))
    return statistics.fmean(finite[-window:])


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[index]
