"""The result of `compare`: one run per dtype on the same batches, and a verdict. Plain
data like `report.py`; `to_dict()` is SPEC.md's compare JSON, with more per run::

    {"schema_version": 1, "command": "compare",
     "runs": [{"dtype": "float16", "status": "nonfinite", "steps_completed": 116,
               "first_nonfinite_step": 116, "final_loss": 0.73,
               "max_abs_loss_diff_vs_reference": 0.02, "step_time_ms": 3.1, ...}, ...],
     "verdict": "bfloat16 survived all 400 steps where float16 went non-finite at step 116 ..."}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from nandoctor.report.health import Headroom
from nandoctor.report.telemetry import Telemetry
from nandoctor.report.types import Tool, jsonable

SCHEMA_VERSION = 1  # SPEC: compare's JSON stays at 1 (the diagnose report is at 2)


@dataclass
class CompareRun:
    dtype: str
    grad_scaler: bool
    status: str  # healthy | nonfinite | interrupted
    steps_completed: int
    first_nonfinite_step: int | None
    first_nonfinite_phase: str | None
    final_loss: float | None  # the last finite loss
    max_abs_loss_diff_vs_reference: float | None  # against float32, over steps both finite
    step_time_ms: float | None  # median
    headroom: list[Headroom] = field(default_factory=list)  # the 5 modules nearest 65504
    telemetry: Telemetry = field(default_factory=Telemetry)
    # a forward that went non-finite: the module whose output did first (its finite peak,
    # 0% for an output all inf, is no measure of it; `runtime.headroom.went_nonfinite_in`)
    nonfinite_module: str | None = None


@dataclass
class CompareEnvironment:
    device: str
    torch: str
    threads: int
    # NB: whose autocast lists the half-precision runs followed (`cuda`: CUDA's, emulated
    # on the CPU; `native`: the device's own), as the diagnose report says it; None in a
    # comparison written before it was recorded
    autocast_policy: str | None = None


@dataclass
class Comparison:
    config: str
    environment: CompareEnvironment
    runs: list[CompareRun]
    verdict: str
    reference: str | None = None  # the dtype others are measured against (float32)
    name: str | None = None
    notes: list[str] = field(default_factory=list)
    command: str = "compare"
    tool: Tool = field(default_factory=Tool)
    schema_version: int = SCHEMA_VERSION

    @property
    def healthy(self) -> bool:
        return all(r.status == "healthy" for r in self.runs)

    @property
    def interrupted(self) -> bool:
        return any(r.status == "interrupted" for r in self.runs)

    @property
    def status(self) -> str:
        """The comparison's, as a report's: error (the user's code ended a run),
        interrupted, healthy (every run), else nonfinite."""
        for worst in ("error", "interrupted"):
            if any(r.status == worst for r in self.runs):
                return worst
        return "healthy" if self.healthy else "nonfinite"

    def run(self, dtype: str) -> CompareRun | None:
        return next((r for r in self.runs if r.dtype == dtype), None)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for run, raw in zip(self.runs, data["runs"], strict=True):
            for h, raw_h in zip(run.headroom, raw["headroom"], strict=True):
                raw_h["activation_fraction"] = h.activation_fraction
                raw_h["gradient_fraction"] = h.gradient_fraction
        order = ["schema_version", "tool", "command", "name", "config", "environment", "reference"]
        order += ["runs", "verdict", "notes"]
        return jsonable({k: data[k] for k in order})

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Comparison:
        from pydantic import TypeAdapter  # NB: here: `lint` reads the cause ids without it

        return TypeAdapter(cls).validate_python(data)
