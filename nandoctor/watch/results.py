"""Read back what the watched processes wrote (see `protocol`), as the engine's own types:
a `RunResult` per process that stepped an optimizer, and a `Localization` from a replay."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from nandoctor.causes.case import RunFacts
from nandoctor.localize.finding import Sighting
from nandoctor.localize.replay import Localization
from nandoctor.report.forecast import Forecast
from nandoctor.report.signals import Curves
from nandoctor.report.telemetry import Event, Telemetry
from nandoctor.report.types import Environment
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.verdict import Reading, StepOutcome, Verdict


@dataclass(frozen=True)
class ChildRun:
    pid: int
    result: RunResult
    environment: Environment
    facts: RunFacts
    rank: int | None = None  # its place in a job of several ranks (`protocol.job_place`)
    world_size: int | None = None


@dataclass(frozen=True)
class Trace:
    """What one process's replay found at the traced step."""

    located: Localization
    reached: bool
    diverged: int | None  # the step the rerun went non-finite at instead, if it did
    rank: int | None = None
    world_size: int | None = None


def attached(folder: str) -> bool:
    return any(Path(folder).glob("attached-*"))


def stopped(folder: str) -> bool:
    """nandoctor stopped a process of the command at its failure (`protocol.stopped_marker`)."""
    return any(Path(folder).glob("stopped-*"))


def raised(folder: str) -> str | None:
    """The exception a process of the command died of, if one did: the first to die (a
    rank's own, not the `ChildFailedError` its launcher then raises)."""
    markers = sorted(Path(folder).glob("raised-*"), key=lambda p: p.stat().st_mtime_ns)
    return markers[0].read_text(encoding="utf-8", errors="replace") if markers else None


def load_runs(folder: str) -> list[ChildRun]:
    """Every process's run, the failing ones first (earliest bad step first)."""
    runs = [_run(json.loads(p.read_text())) for p in sorted(Path(folder).glob("run-*.json"))]
    return sorted(runs, key=_order)


# The phases in the order a step goes through them (weights broken before it first)
_IN_STEP = (
    Phase.PARAMETERS,
    Phase.INPUT,
    Phase.FORWARD,
    Phase.LOSS,
    Phase.BACKWARD,
    Phase.OPTIMIZER,
)


def _order(run: ChildRun) -> tuple:
    """The earliest bad step first; in the same step, the earliest phase: under torchrun
    the rank whose batch went NaN fails in `input`, the ranks the all-reduce handed it
    to in `backward` (they are not its origin)."""
    failure = run.result.failure
    step = failure.step if failure is not None else None
    phase = _IN_STEP.index(failure.phase) if failure is not None and failure.phase else 0
    return (step is None, step if step is not None else 0, phase, -run.result.steps_run, run.pid)


def _run(data: dict[str, Any]) -> ChildRun:
    result = RunResult(
        status=data["status"],
        start_step=data["start_step"],
        steps_run=data["steps_run"],
        failure=_verdict(data["failure"]) if data["failure"] else None,
        telemetry=Telemetry(**data["telemetry"]),
        events=[Event(**e) for e in data["events"]],
        seconds=data["seconds"],
        forecasts=[Forecast(**f) for f in data.get("forecasts", [])],
        signals=_curves(data.get("signals")),
    )
    # NB: validated, not splatted: the facts nest dataclasses (a scheduler's `LrJump`)
    facts = TypeAdapter(RunFacts).validate_python(data["facts"])
    env = Environment(**data["environment"])
    return ChildRun(data["pid"], result, env, facts, data.get("rank"), data.get("world_size"))


def _curves(data: dict[str, Any] | None) -> Curves | None:
    return TypeAdapter(Curves).validate_python(data) if data else None


def _verdict(data: dict[str, Any]) -> Verdict:
    phase = Phase(data["phase"]) if data["phase"] else None
    reading, outcome = Reading(**data["reading"]), StepOutcome(data["outcome"])
    return Verdict(**{**data, "reading": reading, "outcome": outcome, "phase": phase})


def load_rechecks(folder: str) -> dict[int, tuple[bool, bool]]:
    """A recheck run's answers: step -> (the rerun skipped it too, its gradients were
    non-finite at loss scale 1)."""
    answers: dict[int, tuple[bool, bool]] = {}
    for p in sorted(Path(folder).glob("recheck-*.json")):
        for step, skipped, bad in json.loads(p.read_text())["checked"]:
            answers[int(step)] = (bool(skipped), bool(bad))
    return answers


def load_traces(folder: str) -> list[Trace]:
    """Every process's replay, the one that found the failure first first (`_trace_order`)."""
    traces = [_trace(json.loads(p.read_text())) for p in sorted(Path(folder).glob("trace-*.json"))]
    return sorted(traces, key=_trace_order)


def _trace(data: dict[str, Any]) -> Trace:
    located = TypeAdapter(Localization).validate_python(data["localization"])
    place = (data.get("rank"), data.get("world_size"))
    return Trace(located, data["reached"], data["diverged"], *place)


def located_of(
    traces: list[Trace], step: int, last_output: str = "", stopped_after: str | None = None
) -> Localization:
    """What the replay run found at `step` (`traces`: its processes', `load_traces`); a
    note says why when it found nothing (with the rerun's last line of output when it
    ended early; `stopped_after`: the time after which the rerun was stopped for taking
    too long, when it was)."""
    tail = f"; its last output: {last_output}" if last_output else ""
    if stopped_after is not None and not any(t.reached for t in traces):
        # NB: it did not end, it was slower than the first run (its last output is the
        # interrupt that stopped it)
        note = f"the rerun of the command was stopped after {stopped_after}"
        return Localization(step, None, note=note, reached=False)
    if not traces:
        note = f"the rerun of the command never got there{tail}"
        return Localization(step, None, note=note, reached=False)
    first = traces[0]
    if first.diverged is not None:
        note = (
            f"the rerun went non-finite at step {first.diverged} instead, so the script is "
            "not deterministic: seed Python, numpy and torch, and fix its data order"
        )
        # NB: it never ran the step: whether the failure reproduces there is unknown
        return replace(first.located, finding=None, note=note, reached=False)
    if not first.reached:
        note = f"the rerun of the command ended before step {step}{tail}"
        return replace(first.located, finding=None, note=note, reached=False)
    return first.located


def _trace_order(trace: Trace) -> tuple:
    """The process whose replay found the failure first, as `_order` picks the first run's:
    under torchrun every rank (and the launcher, which imports torch but never steps)
    writes a trace; the rank whose batch went NaN found it in `input`, the ranks the
    all-reduce handed it to in `backward`, where a rank whose own backward made it found
    its own op, the others the collective's copy (`received_from_peers`)."""
    finding = trace.located.finding
    in_step = _IN_STEP.index(finding.phase) if finding is not None else 0
    received = received_from_peers(finding)
    return (not trace.reached, trace.diverged is not None, finding is None, received, in_step)


def received_from_peers(finding: Sighting | None) -> bool:
    """The first non-finite value the replay met came from another rank: the op that
    made it, or one of the two levels of ops that made its inputs, is a collective
    (`c10d.allreduce_`, `c10d._reduce_scatter_base_`, ...)."""
    if finding is None:
        return False
    ops = [finding.op or "", *(p.op for p in finding.evidence.producers)]
    return any(op.startswith("c10d.") for op in ops)
