"""The fast run: step the session under the sentinel until the first bad step.

This is the cheap part of `diagnose`: no tracing, one host read per step. It returns what
it saw as plain data (`RunResult`); localisation and diagnosis start from there.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from typing import Any

from nandoctor.errors import PeerFailure, UserCodeError, UserCodeOutOfMemory, UserExit
from nandoctor.report.telemetry import Event
from nandoctor.runtime.precursors import forecasting
from nandoctor.runtime.probe import Probe, Probes
from nandoctor.runtime.recheck import ScaleOneRecheck
from nandoctor.runtime.record import Recorder, RunResult, RunStatus, StepCallback
from nandoctor.runtime.rerun import SessionSteps
from nandoctor.runtime.sentinel import Sentinel
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.step import run_step
from nandoctor.runtime.tensors import floating, nonfinite_data
from nandoctor.setup.session import Session


def fast_run(
    session: Session,
    steps: int,
    *,
    on_step: StepCallback | None = None,
    probe: Probe | None = None,
    store: SnapshotStore | None = None,
    deadline: float | None = None,
    skip_nonfinite_batches: bool = False,
    thorough: bool = False,
    batches: Iterable[tuple[int, Any]] | None = None,
    user_exit_ends_run: bool = False,
    peer_hang_ends_run: bool = False,
    recheck_skips: bool = True,
    forecast: bool = False,
) -> RunResult:
    """Run up to `steps` optimizer steps; stop at the first step the sentinel condemns.

    With a `store`, each step's batch and (by its policy) state are kept first, so that
    the bad step can be replayed; a streak of scaler skips pins the snapshot of its start,
    and each skip is rechecked at loss scale 1 (`runtime.recheck`). Without one, a run
    with a GradScaler keeps its own for the rechecks: every run is judged as `diagnose`
    judges its own (a what-if replay that got past the failing step only because the
    scaler skipped the same NaN is no fix). `recheck_skips=False` leaves the skips
    unchecked (only a streak that collapses the scale fails), for the tests that compare.
    Past `deadline` (a `time.perf_counter()` value) the run stops with status "timeout".
    `skip_nonfinite_batches` drops batches holding NaN or inf (the input-filtering fix).
    `batches` replaces the session's stream (a run resumed from a snapshot starts later).
    With `user_exit_ends_run`, `sys.exit()` or `os._exit()` in the user's code ends the run
    with status "error" (`ended_by` says where), judged on the steps done, not raised, and
    so does an exception it raises in a single process once a step has ended (kept in
    `raised`, for the caller to raise once the report is written; out of memory is the
    machine's, and still raises); with
    `peer_hang_ends_run` (the rank that reports for a data-parallel job), so does another
    rank that hung (it stopped answering the collectives: its data, its model).
    With `forecast` (one process only), the forecast's signals ride on the sentinel's read
    (`runtime.precursors`) and the result carries the forecasts that fired.
    """
    result = RunResult(RunStatus.HEALTHY, session.start_step, 0)
    if store is None and recheck_skips and session.scaler is not None:
        store = snapshot_store(session)  # NB: no scaler, no skip to recheck
    recheck = None if store is None else ScaleOneRecheck(session, store, SessionSteps(session))
    sentinel = Sentinel(session, ranks=session.ranks, thorough=thorough, recheck=recheck)
    others = [probe] if probe is not None else []
    forecaster = None
    if forecast and session.ranks is None:
        precursors, forecaster = forecasting(sentinel, session)
        others.append(precursors)
    recorder = Recorder(result, store=store, on_step=on_step, forecaster=forecaster)
    try:
        with session.autocast_scope(), Probes(sentinel, *others) as probes:
            for step, batch in itertools.islice(batches or session.batches, steps):
                if deadline is not None and time.perf_counter() > deadline:
                    result.status = RunStatus.TIMEOUT
                    break
                if skip_nonfinite_batches and not _finite_batch(batch):
                    result.events.append(Event(step, "skipped-batch"))
                    continue
                if store is not None:
                    store.before_step(step, batch)
                run_step(session, step, batch, probes)
                if recorder.record(sentinel.collect()) is not None:
                    break
            else:
                recorder.record(sentinel.collect(final=True))
    except KeyboardInterrupt:
        result.status = RunStatus.INTERRUPTED
    except (UserExit, PeerFailure) as e:
        ends = user_exit_ends_run if isinstance(e, UserExit) else peer_hang_ends_run and e.hung
        if not ends:
            raise
        result.status, result.ended_by = RunStatus.ERROR, e.message
    except UserCodeError as e:
        alone = session.ranks is None  # NB: a rank that carried on would hang the others
        # NB: raised before any step ended, it is a bad input (a batch the model cannot
        # take): one line, no report, as for any other
        ran = result.steps_run > 0
        if not (user_exit_ends_run and alone and ran) or isinstance(e, UserCodeOutOfMemory):
            raise
        result.status, result.ended_by, result.raised = RunStatus.ERROR, e.message, e
    recorder.stop()
    return result


def snapshot_store(session: Session) -> SnapshotStore:
    """The store of a run nandoctor drives (`diagnose`, `compare`): a snapshot every
    `snapshot.steps` of its config (decided from the state's size when unset), at the
    period every rank of a data-parallel job agrees on; each snapshot notes where the data
    stream stood (a what-if replay resumes there)."""
    ranks = session.ranks
    agree = ranks.largest if ranks is not None else None
    every = session.config.snapshot.steps
    return SnapshotStore(session, every=every, agree=agree, position=session.batches.position)


def _finite_batch(batch: object) -> bool:
    """No NaN or inf but an additive mask's -inf (a mask is no bad data to skip)."""
    tensors = [t for t in floating(batch) if not t.is_meta]
    return not tensors or not bool(nonfinite_data(tensors, tensors[0].device))


__all__ = ["RunResult", "StepCallback", "fast_run", "snapshot_store"]
