"""`nandoctor diagnose`: run the session under the sentinel, replay the bad step under the
tracer, rank the causes, replay the fixes, and, for CI, measure numeric health and gate it
against a baseline.

The engine knows nothing of terminals: the CLI passes callbacks to show progress, and
gets a `Report` back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nandoctor.causes.case import Case, RunFacts
from nandoctor.causes.ranking import rank
from nandoctor.diagnose import verify as whatif
from nandoctor.diagnose.assemble import build_report, rank_reports
from nandoctor.errors import UsageError
from nandoctor.gate.baseline import Baseline
from nandoctor.gate.check import Gate, Tolerances, compare_to_baseline, headroom_check
from nandoctor.localize.replay import Localization, localize, localize_failure
from nandoctor.localize.steps import SessionSteps
from nandoctor.report.evidence import Evidence
from nandoctor.report.health import health_of
from nandoctor.report.trends import trends_of
from nandoctor.report.types import Report
from nandoctor.runtime.fast_run import RunResult, StepCallback, fast_run
from nandoctor.runtime.headroom import HeadroomProbe
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.sentinel import Verdict
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import Session, build_session

SessionCallback = Callable[[Session], None]
DEFAULT_VERIFY_BUDGET = 300.0  # seconds for all what-if replays together
DEFAULT_MAX_HEADROOM = 0.5  # of 65504, checked by default for float16 runs


@dataclass(frozen=True)
class DiagnoseOptions:
    verify: bool = True
    verify_budget: float = DEFAULT_VERIFY_BUDGET
    measure_health: bool = False  # the headroom probe on every step (CI gates, baselines)
    baseline: Baseline | None = None
    baseline_path: str | None = None
    tolerances: Tolerances = field(default_factory=Tolerances)
    time_budget: float | None = None  # seconds for the run itself; then it stops, judged so far


def diagnose(
    loaded: LoadedConfig,
    options: DiagnoseOptions | None = None,
    *,
    on_session: SessionCallback | None = None,
    on_step: StepCallback | None = None,
) -> Report:
    options = options or DiagnoseOptions()
    session = build_session(loaded)
    if session.ranks is not None and options.time_budget:
        raise UsageError("--time-budget is not supported in distributed runs yet; use --steps")
    if on_session is not None:
        on_session(session)
    store = SnapshotStore(session, every=loaded.config.snapshot.steps)
    headroom = HeadroomProbe(session.model) if _measures(options) else None
    deadline = time.perf_counter() + options.time_budget if options.time_budget else None
    result = fast_run(
        session,
        loaded.config.steps,
        on_step=on_step,
        store=store,
        probe=headroom,
        deadline=deadline,
    )
    located, per_rank, interrupted = None, None, False
    failure = result.failure
    if failure is not None and failure.step is not None:
        try:
            located, per_rank, result.failure = _localize(session, store, failure)
            failure = result.failure
        except KeyboardInterrupt:
            interrupted = True
    report = build_report("diagnose", loaded, session, result, located)
    if interrupted:
        report.status = "interrupted"
        report.notes.append("interrupted during the instrumented replay: where and why are unknown")
        return report
    if session.ranks is not None:
        report.ranks = rank_reports(session.ranks.world_size, failure, per_rank)
    if headroom is not None:
        report.health = health_of(result.telemetry, result.events, headroom.peaks())
        report.gate = _gate(report, options)
    if report.first_nonfinite is not None:
        _diagnose_failure(report, loaded, session, result, options)
    if session.ranks is not None:
        session.ranks.leave()
    return report


def _localize(
    session: Session, store: SnapshotStore, failure: Verdict
) -> tuple[Localization, list[Localization] | None, Verdict]:
    """Replay the bad step (on every rank in lockstep): the origin rank's finding, every
    rank's, and the failure, moved one step back when an update broke the weights."""
    per_rank: dict[int, list[Localization]] = {}

    def replay(step: int, loss_scale: float | None) -> Localization:
        located, ranks = _replay_on_ranks(session, store, failure, step, loss_scale)
        if ranks is not None:
            per_rank[step] = ranks
        return located

    located, failure = localize_failure(failure, session.start_step, replay)
    return located, per_rank.get(located.step), failure


def _replay_on_ranks(
    session: Session, store: SnapshotStore, failure: Verdict, step: int, scale: float | None
) -> tuple[Localization, list[Localization] | None]:
    located = localize(session, store, step, SessionSteps(session), loss_scale=scale)
    if session.ranks is None:
        return located, None
    per_rank = session.ranks.gather_objects(located)
    return per_rank[min(failure.reading.origin_ranks, default=0)], per_rank


def _measures(options: DiagnoseOptions) -> bool:
    return options.measure_health or options.baseline is not None


def _diagnose_failure(
    report: Report,
    loaded: LoadedConfig,
    session: Session,
    result: RunResult,
    options: DiagnoseOptions,
) -> None:
    case = case_of(report, run_facts(session, result))
    report.causes = rank(case)
    if session.ranks is not None and options.verify:
        report.notes.append(
            "fixes are not replayed in a distributed run; rerun on one process to verify"
        )
        return
    if not options.verify:
        return
    started = time.perf_counter()
    try:
        deadline = started + options.verify_budget
        report.causes = [whatif.verify(c, case, loaded, deadline) for c in report.causes]
    except KeyboardInterrupt:
        report.status = "interrupted"
        report.notes.append("interrupted while verifying fixes; the causes are not verified")
    report.timing["verify_s"] = round(time.perf_counter() - started, 3)


def _gate(report: Report, options: DiagnoseOptions) -> Gate | None:
    """The headroom limit (float16 runs, or any run given --max-headroom) and the baseline."""
    assert report.health is not None
    tol = options.tolerances
    gate = Gate(options.baseline_path or "")
    if options.baseline is not None:
        gate = compare_to_baseline(report.health, options.baseline.health, gate.baseline, tol)
    limit = tol.max_headroom
    if limit is None and report.environment.dtype == "float16":
        limit = DEFAULT_MAX_HEADROOM
    if limit is not None:
        gate.checks.insert(0, headroom_check(report.health, limit))
    return gate if gate.checks else None


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
