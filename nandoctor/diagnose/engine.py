"""`nandoctor diagnose`: run the session under the sentinel, replay the bad step under the
tracer, rank the causes, replay the fixes, and, for CI, measure numeric health and gate it
against a baseline.

Each stage returns its result (the fast run's `RunResult`, the replay's `Localization`,
the causes, the health and the gate); `assemble` then builds the `Report` from them once.
The engine knows nothing of terminals or exit codes: the CLI passes callbacks to show
progress (the run's steps; the report of where and why before the fixes are replayed,
then each replay), gets the report back, and decides the exit code from it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed

from nandoctor.causes.ranking import rank
from nandoctor.diagnose import verify as whatif
from nandoctor.diagnose.assemble import Findings, assemble
from nandoctor.diagnose.budgets import DEFAULT_VERIFY_BUDGET
from nandoctor.diagnose.explain import case_of
from nandoctor.diagnose.facts import environment_of, facts_of
from nandoctor.diagnose.lr_history import LrHistory
from nandoctor.diagnose.rewind import Replaying, Rewind, budget_after, step_seconds
from nandoctor.diagnose.summary import (
    NOT_VERIFIED_ON_RANKS,
    REPLAY_INTERRUPTED,
    VERIFY_INTERRUPTED,
    run_notes,
)
from nandoctor.errors import NandoctorError, UsageError
from nandoctor.gate.baseline import Baseline, require_comparable, require_same_model
from nandoctor.gate.check import Tolerances, gate_of
from nandoctor.localize.replay import Localization, Recorded, localize, localize_failure
from nandoctor.localize.reproduction import mean_losses
from nandoctor.localize.samples import with_indices
from nandoctor.report.gate import Gate
from nandoctor.report.health import health_of
from nandoctor.report.telemetry import Telemetry
from nandoctor.report.types import Environment, Report
from nandoctor.runtime.fast_run import StepCallback, fast_run, snapshot_store
from nandoctor.runtime.headroom import HeadroomProbe
from nandoctor.runtime.probe import Probes
from nandoctor.runtime.record import RunStatus
from nandoctor.runtime.rerun import SessionSteps
from nandoctor.runtime.sharded import class_name
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.verdict import Verdict
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import Session, build_session
from nandoctor.setup.torch_globals import forget_torch_globals

SessionCallback = Callable[[Session], None]
ReportCallback = Callable[[Report], None]
ReplayCallback = Callable[[Replaying], None]


@dataclass(frozen=True)
class DiagnoseOptions:
    verify: bool = True
    verify_budget: float = DEFAULT_VERIFY_BUDGET
    verify_from_start: bool = False  # every fix refuted from the snapshot, again from the start
    measure_health: bool = False  # the headroom probe on every step (CI gates, baselines)
    gate: bool = True  # judge the health measured (a baseline run records it, unjudged)
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
    on_causes: ReportCallback | None = None,
    on_replay: ReplayCallback | None = None,
    on_replay_step: StepCallback | None = None,
) -> Report:
    """Run, replay, explain; the report of all of it (an interrupt leaves a partial one).
    The user's code raising during the run raises its `UserCodeError`, with the report of
    the steps before (status "error") as its `report`. `on_causes` gets the report of
    where and why before the fixes are replayed; `on_replay` each replay as it starts,
    `on_replay_step` its steps."""
    options = options or DiagnoseOptions()
    forget_torch_globals()  # what an earlier run's code set is not this run's
    session = build_session(loaded)
    if session.ranks is not None and options.time_budget is not None:
        raise UsageError("--time-budget is not supported in distributed runs yet; use --steps")
    if options.baseline is not None:  # NB: before a step runs: nothing half-written
        environment = environment_of(session, autocast_policy=session.autocast_policy)
        require_comparable(options.baseline, options.baseline_path or "", environment)
        # NB: named as the health probe names them: FSDP's `FSDPLinear` is a Linear
        modules = {n: class_name(m) for n, m in session.model.named_modules()}
        require_same_model(options.baseline, options.baseline_path or "", modules)
    if on_session is not None:
        on_session(session)
    ranks = session.ranks
    store = snapshot_store(session)
    headroom = HeadroomProbe(session.model, session.compute_dtype) if _measures(options) else None
    lrs = LrHistory()  # the rate each step ran with, for learning-rate-too-high
    budget = options.time_budget
    deadline = time.perf_counter() + budget if budget is not None else None
    result = fast_run(
        session,
        loaded.config.steps,
        on_step=on_step,
        store=store,
        probe=Probes(lrs, *([headroom] if headroom is not None else [])),
        deadline=deadline,
        user_exit_ends_run=True,
        # NB: rank 0 reports for the job: a rank it waited for in vain ends its run there,
        # judged so far (a rank that waits for a hung rank 0 fails instead, and says why
        # in the job's store, where rank 0's report reads it: cli.diagnose)
        peer_hang_ends_run=ranks is not None and ranks.rank == 0,
        forecast=True,
    )
    run_ended = time.perf_counter()
    findings = Findings(
        "diagnose",
        str(loaded.path),
        environment_of(  # NB: after the run: a distributed run's data sharding is known then
            session,
            autocast_policy=session.autocast_policy,
            data_sharding=session.ranks.data_sharding if session.ranks is not None else None,
        ),
        result,
        name=loaded.config.name,
        notes=run_notes(session, result, loaded.config.steps),
    )
    failure = result.failure
    if failure is not None and failure.step is not None:
        try:
            with session.autocast_scope():  # NB: installed once for all the replayed steps
                located, per_rank, failure = _localize(session, store, failure, result.telemetry)
            # NB: the replay may move the failure a step back: a new result says so
            result = findings.result = replace(result, failure=failure)
            findings.located, findings.per_rank = located, per_rank
        except KeyboardInterrupt:
            findings.interrupted = REPLAY_INTERRUPTED
            return assemble(findings)
    if session.ranks is not None:
        findings.world_size = session.ranks.world_size
    if headroom is not None:
        findings.health = health_of(result.telemetry, result.events, headroom.peaks())
        if options.gate:
            findings.gate = _gate_of(findings, options)
    rewind = Rewind(
        by=budget_after(result, run_ended),
        step_seconds=step_seconds(result),
        always=options.verify_from_start,
        on_replay=on_replay,
        on_step=on_replay_step,
    )
    _causes(findings, loaded, session, options, lrs, store, rewind, on_causes)
    if session.ranks is not None:
        # NB: a rank that hung (status "error") would never reach the final barrier
        _leave(session, interrupted=result.status in (RunStatus.INTERRUPTED, RunStatus.ERROR))
    report = assemble(findings)
    if result.raised is not None:  # the user's code raised: its report rides with the error
        result.raised.report = report
        raise result.raised
    if findings.located is not None and findings.located.out_of_memory is not None:
        raise ReplayOutOfMemory(findings.located, report, session.device)
    return report


class ReplayOutOfMemory(NandoctorError):
    """The instrumented replay ran out of memory even with the lighter trace (exit 2, as
    every out-of-memory failure: the machine's limit). The report of what the run saw
    stands, and rides with the error (`report`): the CLI writes it all the same."""

    def __init__(self, located: Localization, report: Report, device: torch.device) -> None:
        phase = report.first_nonfinite.phase if report.first_nonfinite is not None else None
        seen = f"step {located.step}, phase {phase}" if phase else f"step {located.step}"
        room = "--device cpu (the host's memory), " if device.type == "cuda" else ""
        free = "" if device.type == "cuda" else ", or free some of the host's memory"
        super().__init__(
            f"out of memory in the instrumented replay of step {located.step}, "
            f"{located.out_of_memory}: the report of what the run saw stands ({seen}); "
            "the operator, module and line the replay would have named are unknown",
            hint=f"the replay needs more memory than the run: give it room with {room}a "
            f"smaller batch, or fewer micro-batches in the step it traces (grad_accum_steps)"
            f"{free}",
        )
        self.report = report


def interrupted_before_the_run(loaded: LoadedConfig) -> Report:
    """The report of a run stopped (Ctrl-C, SIGTERM) while it was being built: no step
    ran, and the environment is the config's (no session was made)."""
    config = loaded.config
    env = Environment(
        config.device,
        torch.__version__,
        config.precision.dtype,
        config.precision.use_grad_scaler,
        torch.get_num_threads(),
    )
    summary = "interrupted while building the run, before its first step"
    return Report("diagnose", str(loaded.path), env, "interrupted", 0, summary, name=config.name)


def _leave(session: Session, interrupted: bool) -> None:
    """Leave the job; an interrupted rank (the launcher's SIGTERM reached every rank)
    does not wait at the final barrier for ranks that may be gone already."""
    assert session.ranks is not None
    if not interrupted:
        session.ranks.leave()
        return
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


def _localize(
    session: Session, store: SnapshotStore, failure: Verdict, telemetry: Telemetry
) -> tuple[Localization, list[Localization] | None, Verdict]:
    """Replay the bad step (on every rank in lockstep): the origin rank's finding, every
    rank's, and the failure, moved one step back when an update broke the weights."""
    per_rank: dict[int, list[Localization]] = {}
    # NB: under DDP the run's loss is the ranks' mean, which no rank's replay computes
    single = session.ranks is None
    recorded = dict(zip(telemetry.step, telemetry.loss, strict=True)) if single else None

    def replay(step: int, loss_scale: float | None) -> Localization:
        located, ranks = _replay_on_ranks(session, store, failure, step, loss_scale, recorded)
        if ranks is not None:
            per_rank[step] = ranks
        return located

    located, failure = localize_failure(failure, session.start_step, replay)
    return located, per_rank.get(located.step), failure


def _replay_on_ranks(
    session: Session,
    store: SnapshotStore,
    failure: Verdict,
    step: int,
    scale: float | None,
    recorded: Recorded | None,
) -> tuple[Localization, list[Localization] | None]:
    steps = SessionSteps(session)
    located = localize(session, store, step, steps, loss_scale=scale, recorded=recorded)
    located.finding = with_indices(located.finding, session.batches.indices_of(step))
    if session.ranks is None:
        return located, None
    per_rank = session.ranks.gather_objects(located)
    origin = per_rank[min(failure.reading.origin_ranks, default=0)]
    # NB: the run's loss is the ranks' mean (the telemetry's): so is the replay's
    return replace(origin, losses=mean_losses(r.losses for r in per_rank)), per_rank


def _measures(options: DiagnoseOptions) -> bool:
    return options.measure_health or options.baseline is not None


def _gate_of(findings: Findings, options: DiagnoseOptions) -> Gate | None:
    assert findings.health is not None
    baseline = options.baseline.health if options.baseline is not None else None
    return gate_of(
        findings.health,
        findings.environment.dtype,
        options.tolerances,
        baseline,
        options.baseline_path,
        grad_scaler=findings.environment.grad_scaler,
    )


def _causes(
    findings: Findings,
    loaded: LoadedConfig,
    session: Session,
    options: DiagnoseOptions,
    lrs: LrHistory,
    store: SnapshotStore,
    rewind: Rewind,
    on_causes: ReportCallback | None,
) -> None:
    """The causes of a failure, ranked by the rules (shown to `on_causes`), then verified
    by replaying their fixes within the budget (from the newest snapshot before the
    failure, where a fix allows; from the start again as `rewind` says) and ranked again
    by what the replays showed (not in a distributed run: one process replays them)."""
    result = findings.result
    facts = facts_of(session, result, session.config.checkpoint, lrs)
    case = case_of(result, findings.located, facts)
    if case is None:
        return
    findings.causes = ranked = rank(case)
    if not options.verify:
        return
    if session.ranks is not None:
        findings.later_notes.append(NOT_VERIFIED_ON_RANKS)
        return
    started = time.perf_counter()
    try:
        if on_causes is not None and ranked:
            on_causes(assemble(findings))
        deadline = started + options.verify_budget
        resume = store.resume_point(case.first.step)
        findings.causes = whatif.verify_all(ranked, case, loaded, deadline, resume, rewind)
    except KeyboardInterrupt:
        findings.interrupted = VERIFY_INTERRUPTED
    findings.verify_seconds = time.perf_counter() - started
