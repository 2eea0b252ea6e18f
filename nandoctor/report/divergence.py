"""Divergence before NaN: the loss or the gradient norm rising far above its recent level
while still finite (a bf16 run can reach loss 1e18 without a single NaN).

The rule, per metric (`loss`, `grad_norm`), over the finite positive values in step order:

- track x = ln(value) with an exponential moving mean and variance, alpha 0.97 (ZClip's
  choice: about the last 33 steps weigh most);
- the first `WARMUP` (10) steps only feed the averages: early steps are noisy and a
  warmup schedule moves the level on purpose;
- a step *diverges* when its z-score z = (x - mean) / max(std, `MIN_STD`) exceeds `Z`
  (2.5) and the value is at least `MIN_RATIO` (100x) its recent level exp(mean). The ratio
  keeps a quiet run's small wobble (tiny std, large z) from counting, and two orders of
  magnitude because a healthy run's gradient norm can jump 15x above its average while
  the model leaves its initial plateau (seed-fixed.yaml, step 16); the z-score keeps a
  noisy run's usual swings from counting;
- a loss that rises at once and stays there is judged apart, since the warmup would take
  its new level for the normal one (a far too high learning rate diverges at its first
  steps: AdamW at lr 20 takes a language model's 9.1 to 1.3e4 at step 1, and ~5e3 from
  then on): when the median of the warmup's later half is at least `FROM_START_RATIO`
  (100, as `MIN_RATIO`) times the first loss, the first step at that height diverged,
  against the first loss. A wild start that comes back (1, then 1e3, then ~1) is not that;
- only the first divergence of each metric is an event: `{"step", "kind": "divergence",
  "metric", "value", "baseline"}`, where `baseline` is exp(mean), the recent level.

Deterministic and computed from the report's telemetry alone, so every driver (diagnose,
Guard, watch) gets it the same way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from nandoctor.report.telemetry import Event, Telemetry

ALPHA = 0.97
Z = 2.5
WARMUP = 10
MIN_RATIO = 100.0
MIN_STD = 0.05  # in ln units: a 5% wobble
FROM_START_RATIO = MIN_RATIO  # a loss this many times its first, through the warmup


def divergence_events(telemetry: Telemetry) -> list[Event]:
    """At most one event per metric, in step order."""
    found = [
        first_divergence(telemetry.step, telemetry.loss, "loss"),
        first_divergence(telemetry.step, telemetry.grad_norm, "grad_norm"),
    ]
    return sorted((e for e in found if e is not None), key=lambda e: (e.step, e.metric or ""))


def first_divergence(
    steps: Sequence[int], values: Sequence[float | None], metric: str
) -> Event | None:
    points = [
        (step, value)
        for step, value in zip(steps, values, strict=False)
        if value is not None and math.isfinite(value) and value > 0
    ]
    if metric == "loss" and (at_once := _from_the_start(points)) is not None:
        return at_once
    mean: float | None = None
    var = 0.0
    for seen, (step, value) in enumerate(points):
        x = math.log(value)
        if mean is not None and seen >= WARMUP:
            z = (x - mean) / max(math.sqrt(var), MIN_STD)
            if z > Z and x - mean >= math.log(MIN_RATIO):
                return Event(
                    step, "divergence", metric=metric, value=value, baseline=math.exp(mean)
                )
        if mean is None:
            mean = x
        else:
            delta = x - mean
            mean += (1 - ALPHA) * delta
            var = ALPHA * (var + (1 - ALPHA) * delta * delta)
    return None


def _from_the_start(points: list[tuple[int, float]]) -> Event | None:
    """A loss that left its first value by `FROM_START_RATIO` within the warmup and stayed
    there (the median of the warmup's later half): the first step at that height."""
    warmup = points[1:WARMUP]
    if len(warmup) < WARMUP - 1:
        return None
    first = points[0][1]
    bar = FROM_START_RATIO * first
    if statistics.median(v for _, v in warmup[len(warmup) // 2 :]) < bar:
        return None
    step, value = next((s, v) for s, v in warmup if v >= bar)
    return Event(step, "divergence", metric="loss", value=value, baseline=first)


def merge_events(events: list[Event], extra: list[Event]) -> list[Event]:
    """`events` with `extra` placed by step (stable: a step's own events first)."""
    return sorted([*events, *extra], key=lambda e: e.step)


def divergences(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if e.kind == "divergence"]


def fails_by_divergence(status: str, events: Sequence[Event], divergence_fails: bool) -> bool:
    """A finite run that diverged, asked to fail on it (`--fail-on-divergence`): every
    report of it (terminal, Markdown, JUnit) says failed, as its exit code does."""
    return divergence_fails and status == "healthy" and bool(divergences(events))


def diverged_clause(events: Sequence[Event]) -> str | None:
    """ "the loss diverged at step 1": what a finite run's summary adds (None: nothing)."""
    said = [f"{_name(e)} diverged at step {e.step}" for e in divergences(events)]
    return " and ".join(said) if said else None


def _name(event: Event) -> str:
    return {"grad_norm": "the gradient norm", "loss": "the loss"}.get(event.metric or "", "a value")


def divergence_text(event: Event) -> str:
    """ "loss diverged at step 40: 3.1e+06, 1.3e+06x its recent level 2.4"."""
    name = {"grad_norm": "gradient norm"}.get(event.metric or "", event.metric or "value")
    value, base = event.value or 0.0, event.baseline or 0.0
    ratio = f", {value / base:.3g}x its recent level {base:.3g}" if base > 0 else ""
    return f"{name} diverged at step {event.step}: {value:.3g}{ratio}"
