"""Assemble a `Report` from what the engines saw: the fast run, the localisation, the
session. Sentences for people (the summary) are written here once, for every renderer.
"""

from __future__ import annotations

import dataclasses

import torch

from nandoctor import __version__
from nandoctor.localize.replay import Localization
from nandoctor.localize.tracer import Finding
from nandoctor.report.evidence import Evidence
from nandoctor.report.types import Environment, FirstNonfinite, RankReport, Report, Tool
from nandoctor.runtime.fast_run import RunResult
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.sentinel import Verdict
from nandoctor.setup.devices import CPU_AUTOCAST_NOTE
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import Session

MODULES_IN_EVIDENCE = 10  # the modules with the largest activations, in the report


def build_report(
    command: str,
    loaded: LoadedConfig,
    session: Session,
    result: RunResult,
    located: Localization | None = None,
) -> Report:
    """A report of a run nandoctor built from a config (diagnose, baseline)."""
    notes = session_notes(session)
    if result.status == "timeout":
        notes.append(
            f"time budget: stopped after {result.steps_run} of {loaded.config.steps} steps; "
            "the steps run are judged, the rest are not"
        )
    return report_from(
        command,
        str(loaded.path),
        environment_of(session),
        result,
        located,
        notes,
        loaded.config.name,
    )


def report_from(
    command: str,
    config: str,
    environment: Environment,
    result: RunResult,
    located: Localization | None,
    notes: list[str],
    name: str | None = None,
) -> Report:
    """The report of any run the sentinel watched: diagnose's, or a guarded user loop's."""
    notes = list(notes)
    if located is not None and located.reproduced and located.note:
        notes.append(located.note)
    if located is not None and not located.reproduced:
        seen = " reach the loss, a gradient or a weight" if located.transients else ""
        notes.append(
            f"the instrumented replay of step {located.step} saw no non-finite value{seen}: "
            "the failure is nondeterministic or transient"
            + (f" ({located.note})" if located.note else "")
        )
    timing = {"run_s": round(result.seconds, 3)}
    if located is not None:
        timing["replay_s"] = round(located.seconds, 3)
    return Report(
        command=command,
        config=config,
        name=name,
        environment=environment,
        status="healthy" if result.status == "timeout" else result.status,
        steps_completed=result.steps_completed,
        summary=summarize(result, located),
        first_nonfinite=first_nonfinite(result, located),
        events=result.events,
        telemetry=result.telemetry,
        evidence=evidence_of(located),
        transients=located.transients if located is not None else [],
        notes=notes,
        timing=timing,
        tool=Tool(version=__version__),
    )


def first_nonfinite(result: RunResult, located: Localization | None) -> FirstNonfinite | None:
    failure = result.failure
    if failure is None or failure.step is None or failure.phase is None:
        return None
    found = located.finding if located is not None else None
    if found is None:
        return FirstNonfinite(step=failure.step, phase=failure.phase.value, reproduced=False)
    return _first_of(failure, found)


def _first_of(failure: Verdict, found: Finding) -> FirstNonfinite:
    return FirstNonfinite(
        step=failure.step,
        phase=found.phase.value,
        module=found.module,
        op=found.op,
        tensor=found.tensor,
        value=found.value,
        dtype=found.dtype,
        shape=found.shape,
        count_nonfinite=found.count,
        source=found.source,
        reproduced=True,
        frames=found.frames,
    )


def evidence_of(located: Localization | None) -> Evidence | None:
    if located is None or located.finding is None:
        return None
    return dataclasses.replace(
        located.finding.evidence,
        modules=located.modules[:MODULES_IN_EVIDENCE],
        replayed_from_step=located.from_step,
    )


def environment_of(session: Session) -> Environment:
    return Environment(
        device=str(session.device),
        torch=torch.__version__,
        dtype=str(session.dtype).removeprefix("torch."),
        grad_scaler=session.scaler is not None,
        threads=torch.get_num_threads(),
    )


def session_notes(session: Session) -> list[str]:
    notes = []
    if session.config.device == "auto" and session.device.type == "cpu":
        notes.append("device auto: no CUDA device found, so the run replayed on the CPU")
    if session.device.type == "cpu" and session.dtype != torch.float32:
        notes.append(CPU_AUTOCAST_NOTE)
    return notes


def summarize(result: RunResult, located: Localization | None = None) -> str:
    if result.status == "interrupted":
        return f"interrupted after {result.steps_run} steps; no non-finite value seen before"
    if result.status == "timeout":
        return f"the time budget stopped the run after {result.steps_run} steps, all finite"
    if result.failure is None:
        return f"all {result.steps_run} steps stayed finite"
    f = result.failure
    found = located.finding if located is not None else None
    phase = found.phase if found is not None else f.phase  # the replay's is the precise one
    head = f"step {f.step}, phase {phase.value if phase else '?'}" + _ranks_clause(f)
    if found is None:
        return f"{head}: {f.why}"
    if found.op is None:
        return f"{head}: {found.tensor} held {found.count} {found.value} value(s)"
    sentence = _origin_sentence(found)
    streak = f.phase is Phase.BACKWARD and f.reading.scale is not None
    return f"{head}: {f.why}; {sentence}" if streak else f"{head}: {sentence}"


def _origin_sentence(found) -> str:
    parts = [found.op]
    if found.evidence.backward_of:
        parts.append(f"in the backward of {found.evidence.backward_of}")
    if found.module is not None:
        parts.append(f"in {found.module or '(root)'}")
    if found.source:
        parts.append(f"at {found.source}")
    what = f"{found.value} in its {found.tensor} ({found.count} of {found.dtype} {found.shape})"
    return " ".join(parts) + f" produced {what}"


def rank_reports(
    world_size: int, failure: Verdict | None, located: list | None
) -> list[RankReport]:
    """Per rank: where the non-finite value was born (origin), or got in (inherited)."""
    origin = set(failure.reading.origin_ranks) if failure else set()
    inherited = set(failure.reading.inherited_ranks) if failure else set()
    out = []
    for rank in range(world_size):
        status = "origin" if rank in origin else ("inherited" if rank in inherited else "clean")
        found = located[rank].finding if located is not None else None
        first = _first_of(failure, found) if found is not None and failure is not None else None
        out.append(RankReport(rank, status, first))
    return out


def _ranks_clause(failure: Verdict) -> str:
    origin, inherited = failure.reading.origin_ranks, failure.reading.inherited_ranks
    if not origin:
        return ""
    clause = f", born on rank {', '.join(map(str, origin))}"
    if inherited:
        clause += f" (rank {', '.join(map(str, inherited))} inherited it through the all-reduce)"
    return clause
