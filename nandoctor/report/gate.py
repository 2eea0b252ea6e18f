"""The gate's verdict as plain data: named checks that passed or failed.

`gate.check` makes a `Gate` from a run's numeric health (the headroom limit, a recorded
baseline); the report carries it and the CLI reads `passed` to choose the exit code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GateCheck:
    name: str  # "headroom", "activation growth", ...
    passed: bool
    message: str


@dataclass
class Gate:
    baseline: str  # the baseline file ("" when only the headroom limit was checked)
    checks: list[GateCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


__all__ = ["Gate", "GateCheck"]
