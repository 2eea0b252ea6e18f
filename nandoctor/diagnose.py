"""`nandoctor diagnose`: run the session under the sentinel, replay the bad step under the
tracer, and assemble the report.

The engine knows nothing of terminals: the CLI passes callbacks to show progress, and
gets a `Report` back.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from nandoctor import __version__, whatif
from nandoctor.configfile import LoadedConfig
from nandoctor.devices import CPU_AUTOCAST_NOTE
from nandoctor.diagnosis.case import Case, RunFacts
from nandoctor.diagnosis.evidence import Evidence
from nandoctor.diagnosis.rules import rank
from nandoctor.diagnosis.trends import trends_of
from nandoctor.localize import Localization, localize
from nandoctor.probes.base import Phase
from nandoctor.replay import RunResult, StepCallback, fast_run
from nandoctor.report import Environment, FirstNonfinite, Report, Tool
from nandoctor.session import Session, build_session
from nandoctor.snapshot import SnapshotStore

SessionCallback = Callable[[Session], None]
MODULES_IN_EVIDENCE = 10  # the modules with the largest activations, in the report


DEFAULT_VERIFY_BUDGET = 300.0  # seconds for all what-if replays together


def diagnose(
    loaded: LoadedConfig,
    *,
    on_session: SessionCallback | None = None,
    on_step: StepCallback | None = None,
    verify: bool = True,
    verify_budget: float = DEFAULT_VERIFY_BUDGET,
) -> Report:
    session = build_session(loaded)
    if on_session is not None:
        on_session(session)
    store = SnapshotStore(session, every=loaded.config.snapshot.steps)
    result = fast_run(session, loaded.config.steps, on_step=on_step, store=store)
    located = None
    failure = result.failure
    if failure is not None and failure.step is not None:
        collapsed = failure.phase is Phase.BACKWARD and failure.reading.scale is not None
        scale = failure.reading.scale if collapsed else None
        located = localize(session, store, failure.step, loss_scale=scale)
    report = build_report("diagnose", loaded, session, result, located)
    if report.first_nonfinite is None:
        return report
    case = case_of(report, run_facts(session, result))
    report.causes = rank(case)
    if verify:
        started = time.perf_counter()
        try:
            deadline = started + verify_budget
            report.causes = [whatif.verify(c, case, loaded, deadline) for c in report.causes]
        except KeyboardInterrupt:
            report.status = "interrupted"
            report.notes.append("interrupted while verifying fixes; the causes are not verified")
        report.timing["verify_s"] = round(time.perf_counter() - started, 3)
    return report


def case_of(report: Report, facts: RunFacts) -> Case:
    """What the rules read: the report's failure and evidence, its trends, the settings."""
    assert report.first_nonfinite is not None
    trends = trends_of(report.telemetry, report.events)
    return Case(report.first_nonfinite, report.evidence or Evidence(), trends, facts)


def run_facts(session: Session, result: RunResult) -> RunFacts:
    defaults = session.optimizer.defaults
    failure = result.failure
    collapsed = (
        failure is not None
        and failure.phase is Phase.BACKWARD
        and failure.reading.scale is not None
    )
    params = session.params
    return RunFacts(
        dtype=str(session.dtype).removeprefix("torch."),
        grad_scaler=session.scaler is not None,
        clip_grad_norm=session.config.clip_grad_norm,
        optimizer=type(session.optimizer).__name__,
        lr=_number(defaults.get("lr")),
        eps=_number(defaults.get("eps")),
        param_dtype=str(params[0].dtype).removeprefix("torch.") if params else "float32",
        checkpoint=session.config.checkpoint,
        start_step=session.start_step,
        collapsed=collapsed,
        collapse_why=failure.why if collapsed else "",
    )


def _number(value: object) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return float(value) if isinstance(value, (int, float)) else None


def build_report(
    command: str,
    loaded: LoadedConfig,
    session: Session,
    result: RunResult,
    located: Localization | None = None,
) -> Report:
    notes = session_notes(session)
    if located is not None and located.reproduced and located.note:
        notes.append(located.note)
    if located is not None and not located.reproduced:
        notes.append(
            f"the instrumented replay of step {located.step} saw no non-finite value: "
            "the failure is nondeterministic or transient"
            + (f" ({located.note})" if located.note else "")
        )
    timing = {"run_s": round(result.seconds, 3)}
    if located is not None:
        timing["replay_s"] = round(located.seconds, 3)
    return Report(
        command=command,
        config=str(loaded.path),
        name=loaded.config.name,
        environment=environment_of(session),
        status=result.status,
        steps_completed=result.steps_completed,
        summary=summarize(result, located),
        first_nonfinite=first_nonfinite(result, located),
        events=result.events,
        telemetry=result.telemetry,
        evidence=evidence_of(located),
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
    if result.failure is None:
        return f"all {result.steps_run} steps stayed finite"
    f = result.failure
    head = f"step {f.step}, phase {f.phase.value if f.phase else '?'}"
    found = located.finding if located is not None else None
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
