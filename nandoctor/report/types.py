"""The report: plain data, the seam between the engines and everything that reads them.

Engines (diagnose, compare, watch) build a `Report`; renderers (terminal, Markdown,
JUnit) and CI read it and never compute anything new. `to_dict()` is the JSON of SPEC.md,
schema_version 2, for example (abridged)::

    {"schema_version": 2, "command": "diagnose", "status": "nonfinite",
     "steps_completed": 57,
     "first_nonfinite": {"step": 57, "phase": "loss", "module": null, ...,
                         "frames": [{"file": "train.py", "line": 31, "user": true}]},
     "causes": [], "transients": [],
     "events": [{"step": 12, "kind": "scaler-skip", "scale": 32768.0}],
     "telemetry": {"step": [0, 1, ...], "loss": [2.3, 2.1, ...], ...}}

Non-finite floats are written as the strings "nan", "inf" and "-inf" (JSON has no NaN);
`from_dict` reads them back as floats. Nothing here imports torch.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from nandoctor.report.evidence import Evidence
from nandoctor.report.forecast import Forecast
from nandoctor.report.gate import Gate
from nandoctor.report.health import Health
from nandoctor.report.signals import Curves
from nandoctor.report.telemetry import Event, Telemetry

SCHEMA_VERSION = 2  # 2: first_nonfinite.frames, transients


@dataclass(frozen=True)
class Tool:
    name: str = "nandoctor"
    version: str = ""


@dataclass(frozen=True)
class Environment:
    device: str
    torch: str
    dtype: str
    grad_scaler: bool
    threads: int
    autocast_policy: str = "native"  # cuda: CUDA's cast lists emulated | native: the device's
    data_sharding: str | None = None  # distributed: self | sampler | by-position


@dataclass(frozen=True)
class Frame:
    """One line of the call stack that issued an op: a library's (transformers' modeling
    file, torch.nn.functional) or the user's own (`user`)."""

    file: str
    line: int
    user: bool


@dataclass(frozen=True)
class Transient:
    """A non-finite value that healed before the failure (selected away by `where`,
    filled, cast to integers, summed out by a softmax): seen, listed, never the cause."""

    step: int
    phase: str
    module: str | None
    op: str | None
    value: str  # nan | inf | -inf | mixed
    source: str | None


@dataclass(frozen=True)
class Sample:
    """A row of the batch (along its first dimension) that holds the non-finite value,
    or makes the op where it began non-finite when run without the other rows."""

    row: int
    index: int | None = None  # the dataset index, for a DataLoader over a map-style dataset
    nonfinite: int = 0  # how many of the origin tensor's non-finite values are this row's


@dataclass(frozen=True)
class FirstNonfinite:
    """Where the first non-finite value appeared. Fields other than step and phase stay
    None until the instrumented replay localises the tensor."""

    step: int
    phase: str
    module: str | None = None
    op: str | None = None
    tensor: str | None = None
    value: str | None = None  # nan | inf | -inf | mixed
    dtype: str | None = None
    shape: list[int] | None = None
    count_nonfinite: int | None = None
    source: str | None = None
    # the instrumented replay of the step: exact (went non-finite, every loss it recomputed
    # equal to the run's) | values-differ (non-finite, other values) | not-reproduced (no
    # non-finite value: a transient); None: not replayed
    reproduced: str | None = None
    micro_batch: int | None = None  # with grad_accum_steps > 1: the batch within the step
    frames: list[Frame] = field(default_factory=list)  # innermost first; the user's last
    samples: list[Sample] = field(default_factory=list)  # [] where not known


@dataclass(frozen=True)
class RankReport:
    """One rank of a data-parallel run."""

    rank: int
    status: str  # origin: went non-finite on its own | inherited: through the all-reduce | clean
    first_nonfinite: FirstNonfinite | None = None  # what this rank's replay saw first


@dataclass(frozen=True)
class Cause:
    id: str
    title: str
    confidence: float
    evidence: list[str] = field(default_factory=list)
    fix: str = ""
    verified: bool | None = None
    verification: str | None = None


@dataclass
class Report:
    command: str
    config: str
    environment: Environment
    status: str  # healthy | nonfinite | error | interrupted
    steps_completed: int
    summary: str = ""  # one sentence: what happened
    first_nonfinite: FirstNonfinite | None = None
    causes: list[Cause] = field(default_factory=list)
    transients: list[Transient] = field(default_factory=list)  # healed on the way
    forecast: list[Forecast] = field(default_factory=list)  # failures seen coming, best first
    events: list[Event] = field(default_factory=list)
    telemetry: Telemetry = field(default_factory=Telemetry)
    evidence: Evidence | None = None  # what the instrumented replay of the bad step saw
    health: Health | None = None  # numeric health, when a gate or baseline asked for it
    gate: Gate | None = None  # the baseline comparison, with --baseline
    ranks: list[RankReport] | None = None  # data-parallel runs: one entry per rank
    timing: dict[str, float] = field(default_factory=dict)  # seconds; excluded from equality
    name: str | None = None
    notes: list[str] = field(default_factory=list)
    tool: Tool = field(default_factory=Tool)
    # NB: the forecast's signals a step, for TensorBoard: not in the JSON (not in `_ORDER`)
    signals: Curves | None = field(default=None, compare=False)
    schema_version: int = SCHEMA_VERSION

    @property
    def healthy(self) -> bool:
        return self.status == "healthy"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(dataclasses.replace(self, signals=None))  # NB: not copied
        data["events"] = [_event_dict(e) for e in data["events"]]
        ordered = {k: data[k] for k in _ORDER if k in data}
        return jsonable(ordered)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        """The inverse of `to_dict` (for baselines, tests and tools reading reports)."""
        from pydantic import TypeAdapter  # NB: here: `lint` reads the cause ids without it

        return TypeAdapter(cls).validate_python(_reproduced_as_a_word(data))


def _reproduced_as_a_word(data: dict[str, Any]) -> dict[str, Any]:
    """A report written before `reproduced` was a word held a boolean: true (the replay
    named an origin, its values not compared: "exact" is the nearest word) or false. A
    copy: the caller's data stays as it was."""
    data = copy.deepcopy(data)
    ranks = data.get("ranks") or []
    for first in [data.get("first_nonfinite"), *(r.get("first_nonfinite") for r in ranks)]:
        if isinstance(first, dict) and isinstance(first.get("reproduced"), bool):
            first["reproduced"] = "exact" if first["reproduced"] else "not-reproduced"
    return data


_ORDER = (
    "schema_version", "tool", "command", "name", "config", "environment", "status",
    "steps_completed", "summary", "first_nonfinite", "causes", "transients", "forecast",
    "events", "telemetry", "evidence", "health", "gate", "ranks", "notes", "timing",
)  # fmt: skip


def _event_dict(event: dict[str, Any]) -> dict[str, Any]:
    """Each kind of event with its own keys, as SPEC.md writes them: a divergence's
    metric, value and baseline; a forecast's cause and eta_steps; a skip's scale and
    reason."""
    own = _OWN_KEYS.get(event.get("kind") or "", _SKIP_KEYS)
    return {k: v for k, v in event.items() if k in _COMMON_KEYS or k in own}


_COMMON_KEYS = ("step", "kind")
_SKIP_KEYS = ("scale", "reason")
_OWN_KEYS = {"divergence": ("metric", "value", "baseline"), "forecast": ("cause", "eta_steps")}


def jsonable(obj: Any) -> Any:
    """Plain JSON values; non-finite floats become "nan", "inf" and "-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj
