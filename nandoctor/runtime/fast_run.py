"""The fast run: step the session under the sentinel until the first bad step.

This is the cheap part of `diagnose`: no tracing, one host read per step. It returns what
it saw as plain data (`RunResult`); localisation and diagnosis start from there.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nandoctor.report.types import Event, Telemetry
from nandoctor.runtime.probe import Probe, Probes
from nandoctor.runtime.sentinel import Sentinel, Verdict
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.step import run_step
from nandoctor.runtime.tensors import floating
from nandoctor.setup.session import Session

StepCallback = Callable[[Verdict], None]


@dataclass
class RunResult:
    status: str  # healthy | nonfinite | interrupted | timeout
    start_step: int
    steps_run: int  # steps whose verdict arrived (the bad one included)
    failure: Verdict | None = None
    telemetry: Telemetry = field(default_factory=Telemetry)
    events: list[Event] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # wall time between verdicts
    _last_verdict_at: float = field(default=0.0, repr=False)

    @property
    def steps_completed(self) -> int:
        """Clean optimizer steps before the first bad one (SPEC's `steps_completed`)."""
        if self.failure is not None and self.failure.step is not None:
            return self.failure.step - self.start_step
        return self.steps_run


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
) -> RunResult:
    """Run up to `steps` optimizer steps; stop at the first step the sentinel condemns.

    With a `store`, each step's batch and (by its policy) state are kept first, so that
    the bad step can be replayed; a streak of scaler skips pins the snapshot of its start.
    Past `deadline` (a `time.perf_counter()` value) the run stops with status "timeout".
    `skip_nonfinite_batches` drops batches holding NaN or inf (the input-filtering fix).
    """
    result = RunResult("healthy", session.start_step, 0)
    sentinel = Sentinel(session, thorough=thorough)
    started = result._last_verdict_at = time.perf_counter()
    try:
        with Probes(sentinel, probe) as probes:
            for step, batch in itertools.islice(session.batches, steps):
                if deadline is not None and time.perf_counter() > deadline:
                    result.status = "timeout"
                    break
                if skip_nonfinite_batches and not _finite_batch(batch):
                    result.events.append(Event(step, "skipped-batch"))
                    continue
                if store is not None:
                    store.before_step(step, batch)
                run_step(session, step, batch, probes)
                if _absorb(result, sentinel.collect(), on_step, store):
                    break
            else:
                _absorb(result, sentinel.collect(final=True), on_step, store)
    except KeyboardInterrupt:
        result.status = "interrupted"
    result.seconds = time.perf_counter() - started
    return result


def _absorb(result: RunResult, verdicts, on_step: StepCallback | None, store) -> bool:
    """Record verdicts into `result`; True once one of them is a failure."""
    for v in verdicts:
        r = v.reading
        now = time.perf_counter()
        result.step_seconds.append(now - result._last_verdict_at)
        result._last_verdict_at = now
        result.steps_run += 1
        result.telemetry.append(r.step, r.loss, r.grad_norm, r.scale)
        if v.skipped:
            result.events.append(Event(r.step, "scaler-skip", r.scale))
        if store is not None:
            _keep_streak_start(store, v)
        if on_step is not None:
            on_step(v)
        if v.failed:
            result.status, result.failure = "nonfinite", v
            return True
    return False


def _finite_batch(batch) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in floating(batch))


def _keep_streak_start(store: SnapshotStore, v: Verdict) -> None:
    if v.skipped and v.streak_start == v.reading.step:
        store.pin(v.reading.step)
    elif not v.skipped and not v.failed:
        store.unpin()
