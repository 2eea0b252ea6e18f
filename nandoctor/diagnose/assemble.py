"""The one report assembly: every driver (`diagnose`, `Guard`, `watch`) hands in what its
engines returned, as `Findings`, and `assemble` builds the `Report` from it once.

The engines run first and return plain results (the fast run's `RunResult`, the replay's
`Localization`, the ranked and verified causes, the health and the gate); nothing here
runs anything, and nothing after this writes into the report. The report's status is
decided here too (`status_of`), so a status rule is written once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from nandoctor.diagnose.summary import dead_gradients_note, replay_notes, summarize
from nandoctor.errors import ExitCode
from nandoctor.localize.finding import batch_finding
from nandoctor.localize.replay import Localization
from nandoctor.localize.reproduction import Reproduction, reproduction
from nandoctor.localize.tracer import Sighting
from nandoctor.report.divergence import divergence_events, merge_events
from nandoctor.report.evidence import Evidence
from nandoctor.report.gate import Gate
from nandoctor.report.health import Health
from nandoctor.report.types import Cause, Environment, FirstNonfinite, RankReport, Report, Tool
from nandoctor.runtime.record import RunResult, RunStatus
from nandoctor.runtime.verdict import Verdict
from nandoctor.version import __version__

MODULES_IN_EVIDENCE = 10  # the modules with the largest activations, in the report


@dataclass
class Findings:
    """What the engines returned about one run: everything its report is made of.

    The driver says what ran (`command`, `config`, `name`, `environment`) and what it
    noticed (`notes`, first in the report); the sentinel what it saw (`result`); the
    replay where (`located`, and per rank in a data-parallel run); the rules and the
    what-if replays why (`causes`); the headroom probe and the gate how healthy.
    """

    command: str
    config: str
    environment: Environment
    result: RunResult
    name: str | None = None
    notes: list[str] = field(default_factory=list)
    located: Localization | None = None
    causes: list[Cause] = field(default_factory=list)
    health: Health | None = None
    gate: Gate | None = None
    world_size: int | None = None  # a data-parallel run's; None for one process
    per_rank: list[Localization] | None = None  # each rank's replay, in rank order
    later_notes: list[str] = field(default_factory=list)  # the engines', after the replay's
    interrupted: str | None = None  # what an interrupt cut short, as the report says it
    verify_seconds: float | None = None  # the what-if replays', when they ran
    command_code: int | None = None  # watch: the exit code of the watched command


def assemble(findings: Findings) -> Report:
    """The report of a run, built once from what its engines returned."""
    f = findings
    status = status_of(f.result, f.interrupted is not None, f.command_code)
    events = merge_events(f.result.events, divergence_events(f.result.telemetry))
    return Report(
        command=f.command,
        config=f.config,
        name=f.name,
        environment=f.environment,
        status=status,
        steps_completed=f.result.steps_completed,
        summary=summarize(status, f.result, f.located, f.command_code, events),
        first_nonfinite=first_nonfinite(f.result, f.located),
        causes=list(f.causes),
        events=events,
        telemetry=f.result.telemetry,
        evidence=evidence_of(f.located),
        transients=f.located.transients if f.located is not None else [],
        forecast=list(f.result.forecasts),
        signals=f.result.signals,
        health=f.health,
        gate=f.gate,
        ranks=_ranks(f),
        notes=_notes(f),
        timing=_timing(f),
        tool=Tool(version=__version__),
    )


def status_of(result: RunResult, interrupted: bool = False, command_code: int | None = None) -> str:
    """healthy | nonfinite | interrupted | error: the report's status, decided once.

    An interrupt during the replay or the what-if replays outranks what the run found;
    a watched command's own ending counts when the sentinel saw nothing (it may have
    crashed or been stopped); a run stopped by its time budget is judged on the steps done.
    """
    if interrupted:
        return "interrupted"
    if command_code is not None:
        if result.failure is not None:
            return "nonfinite"
        if command_code == ExitCode.INTERRUPTED:
            return "interrupted"
        return "healthy" if command_code == 0 else "error"
    return "healthy" if result.status is RunStatus.TIMEOUT else result.status.value


def first_nonfinite(result: RunResult, located: Localization | None) -> FirstNonfinite | None:
    """Where the sentinel saw the failure, made precise by the replay's finding, and
    whether the replay reproduced it (`reproduction`: exact, values-differ,
    not-reproduced; None where nothing was replayed, as in Guard's `with` form)."""
    failure = result.failure
    if failure is None or failure.step is None or failure.phase is None:
        return None
    replayed = reproduction_of(result, located)
    reproduced = replayed.word if replayed is not None else None
    found = located.finding if located is not None else None
    if found is None:
        found = batch_finding(failure)
        if found is not None:  # NB: the sentinel kept the batch: named, not replayed
            return _first_of(failure.step, found, reproduced)
        return FirstNonfinite(step=failure.step, phase=failure.phase.value, reproduced=reproduced)
    return _first_of(failure.step, found, reproduced)


def reproduction_of(result: RunResult, located: Localization | None) -> Reproduction | None:
    """The replay's losses held against the run's telemetry (`localize.reproduction`)."""
    t = result.telemetry
    return reproduction(located, dict(zip(t.step, t.loss, strict=False)))


def evidence_of(located: Localization | None) -> Evidence | None:
    """What the replay saw around the origin, with the modules' largest magnitudes."""
    if located is None or located.finding is None:
        return None
    return dataclasses.replace(
        located.finding.evidence,
        modules=located.modules[:MODULES_IN_EVIDENCE],
        replayed_from_step=located.from_step,
    )


def rank_reports(
    world_size: int,
    failure: Verdict | None,
    located: list[Localization] | None,
    reproduced: str | None = None,
) -> list[RankReport]:
    """Per rank: where the non-finite value was born (origin), or got in (inherited);
    `reproduced`: the word of the job's replay, which every rank ran in lockstep."""
    origin = set(failure.reading.origin_ranks) if failure else set()
    inherited = set(failure.reading.inherited_ranks) if failure else set()
    out = []
    for rank in range(world_size):
        status = "origin" if rank in origin else ("inherited" if rank in inherited else "clean")
        found = located[rank].finding if located is not None else None
        first = (
            _first_of(failure.step, found, reproduced)
            if found is not None and failure is not None and failure.step is not None
            else None
        )
        out.append(RankReport(rank, status, first))
    return out


def _first_of(step: int, found: Sighting, reproduced: str | None = None) -> FirstNonfinite:
    return FirstNonfinite(
        step=step,
        phase=found.phase.value,
        module=found.module,
        op=found.op,
        tensor=found.tensor,
        value=found.value,
        dtype=found.dtype,
        shape=found.shape,
        count_nonfinite=found.count,
        source=found.source,
        reproduced=reproduced,
        frames=found.frames,
        micro_batch=found.micro_batch,
        samples=list(found.samples),
    )


def _ranks(f: Findings) -> list[RankReport] | None:
    if f.world_size is None:
        return None
    first = first_nonfinite(f.result, f.located)
    reproduced = first.reproduced if first is not None else None
    return rank_reports(f.world_size, f.result.failure, f.per_rank, reproduced)


def _notes(f: Findings) -> list[str]:
    """The driver's notes, then the replay's, then the engines' (an interrupt last)."""
    interrupted = [f.interrupted] if f.interrupted is not None else []
    replay = replay_notes(f.located, f.result.failure, reproduction_of(f.result, f.located))
    dead = dead_gradients_note(f.result)
    return [*f.notes, *replay, *dead, *f.later_notes, *interrupted]


def _timing(f: Findings) -> dict[str, float]:
    timing = {"run_s": round(f.result.seconds, 3)}
    if f.located is not None:
        timing["replay_s"] = round(f.located.seconds, 3)
    if f.verify_seconds is not None:
        timing["verify_s"] = round(f.verify_seconds, 3)
    return timing
