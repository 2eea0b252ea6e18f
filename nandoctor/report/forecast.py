"""A forecast: a failure seen coming, before any value is non-finite.

A cause of the catalog, named while the run is still finite, from a signal whose recent
trend crosses its limit within the horizon (`report.forecaster`, `report.forecast_rules`)::

    {"step": 150, "kind": "fp16-overflow", "module": "encoder.block.0.layer.1.DenseReluDense.wo",
     "op": null, "metric": "activation_peak", "value": 8100.0, "limit": 65504.0,
     "eta_steps": 38, "confidence": 0.7, "why": "its largest |output| grew 1.06x a step ..."}

`step` is the step it first fired at; `eta_steps` how many steps after it the fitted trend
reaches `limit`. The fix is the cause's own, from the catalog. Plain data, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nandoctor.report.telemetry import Event

FORECAST = "forecast"  # the event's kind


@dataclass(frozen=True)
class Forecast:
    step: int
    kind: str  # a cause id
    module: str | None
    op: str | None
    metric: str
    value: float
    limit: float
    eta_steps: int
    confidence: float
    why: str

    @property
    def due(self) -> int:
        """The step the trend reaches its limit."""
        return self.step + self.eta_steps

    def event(self) -> Event:
        return Event(self.step, FORECAST, cause=self.kind, eta_steps=self.eta_steps)


def best_first(forecasts: Sequence[Forecast]) -> list[Forecast]:
    """The most confident first; among equals, the soonest due."""
    return sorted(forecasts, key=lambda f: (-f.confidence, f.due, f.step))


def fails_by_forecast(forecasts: Sequence[Forecast], forecast_fails: bool) -> bool:
    """A forecast was made and the run was asked to fail on one (`--fail-on-forecast`)."""
    return forecast_fails and bool(forecasts)


def where_text(f: Forecast) -> str:
    """`, in encoder.block.0.wo`, `, outside the model (the loss)`, or nothing for a
    signal of the whole run (the gradient norm, an update ratio, the loss scale)."""
    if f.module is not None:
        return f", in {f.module or '(root)'}"
    return ", outside the model (the loss)" if f.op is not None else ""


def forecast_text(f: Forecast) -> str:
    """One line: "step 150: fp16-overflow in about 38 steps (step 188), in encoder.wo:
    activation_peak 8.1e+03 of 65504; its largest |output| grew 1.06x a step ..."."""
    op = f" ({f.op})" if f.op else ""
    return (
        f"step {f.step}: {f.kind} in about {plural(f.eta_steps)} (step {f.due})"
        f"{where_text(f)}{op}: {f.metric} {num(f.value)} of {num(f.limit)}; {f.why}"
    )


def plural(steps: int) -> str:
    return f"{steps} step" + ("" if steps == 1 else "s")


def num(x: float) -> str:
    """3 significant digits: 65504, 8.1e+03, 0.021, 17.3."""
    if not math.isfinite(x):
        return str(x)
    return f"{x:.0f}" if x == int(x) and abs(x) < 1e6 else f"{x:.3g}"


__all__ = ["FORECAST", "Forecast", "best_first", "fails_by_forecast", "forecast_text"]
