"""Per-step records of a run: its telemetry curves and its events (GradScaler skips).

Plain data, shared by the report, the comparison, the trends and the health measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Event:
    step: int
    kind: str  # scaler-skip | ...
    scale: float | None = None


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
