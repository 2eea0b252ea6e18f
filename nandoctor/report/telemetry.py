"""Per-step records of a run: its telemetry curves and its events (GradScaler skips, by
reason).

Plain data, shared by the report, the comparison, the trends and the health measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    step: int
    kind: str  # scaler-skip | skipped-batch | divergence | forecast
    scale: float | None = None
    # a scaler-skip's: "overflow" (the gradients were finite at loss scale 1) or
    # "unchecked" (the driver could not rerun the step: Guard's hooks, watch)
    reason: str | None = None
    # a divergence's (report.divergence): the metric ("loss" | "grad_norm"), its value at
    # the step, and the recent level it rose from
    metric: str | None = None
    value: float | None = None
    baseline: float | None = None
    # a forecast's (report.forecast): the cause seen coming, and in how many steps
    cause: str | None = None
    eta_steps: int | None = None


def scaler_skips(events: list[Event]) -> dict[str, int]:
    """How many GradScaler skips of each reason there were (none: {}); a skip recorded
    without a reason (a report from before reasons) counts as unchecked."""
    counts: dict[str, int] = {}
    for e in events:
        if e.kind == "scaler-skip":
            reason = e.reason or "unchecked"
            counts[reason] = counts.get(reason, 0) + 1
    return counts


def skips_text(events: list[Event]) -> str | None:
    """The skips for a summary, "GradScaler skips: 3 overflow, 1 unchecked" (None: none)."""
    counts = scaler_skips(events)
    if not counts:
        return None
    return "GradScaler skips: " + ", ".join(f"{n} {reason}" for reason, n in counts.items())


@dataclass
class Telemetry:
    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    scale: list[float | None] = field(default_factory=list)

    def append(self, step: int, loss: float, grad_norm: float, scale: float | None) -> None:
        self.step.append(step)
        self.loss.append(loss)
        self.grad_norm.append(grad_norm)
        self.scale.append(scale)
