"""The loops being compared, taking turns at stepping one shared run (see
`measure.step_times`: separate copies of a run differ in speed on their own).

- plain: the loop a user writes (autocast, GradScaler, unscale_, step, update; a float32
  loop enters no autocast at all);
- loop: nandoctor's step with no probe (the price of the phases alone);
- plain+norm: the plain loop plus each gradient's sum of squares (the sentinel's kernels,
  right after the backward), read each step: the least any exact per-step check of the
  gradients costs (the sentinel's floor);
- sentinel: nandoctor's step with the sentinel, read every step (what `diagnose` runs);
- sentinel+snapshots: the same, plus the snapshot store (what `diagnose` really runs);
- sentinel+forecast: the sentinel with the forecast's signals riding on its read
  (`runtime.precursors`) and the forecaster judging them on the host (docs/forecast.md);
- guard: the plain loop, unchanged, inside `with nandoctor.Guard(...)`: the hooks that
  follow a user's loop driving the same sentinel (what `Guard` and `watch` cost a step);
- guard.step: each plain step passed to `guard.step(fn, batch)`: explicit hooks, the
  sentinel, and the snapshots its replay needs (next to sentinel+snapshots);
- watch: the plain loop followed as `nandoctor watch` follows a script: the hooks
  discover the model, optimizer and scaler, the sentinel's verdicts are recorded at
  each step's end (the watched process's path, without its files);
- anomaly: the plain loop under `torch.autograd.set_detect_anomaly(True)`;
- transformers: the plain loop with transformers' `DebugUnderflowOverflow` (optional).

NB: the global hooks of guard and watch are attached only while that candidate runs
(`attached()`), so that they never slow the candidates interleaved with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nandoctor.guard import Guard
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.precursors import forecasting
from nandoctor.runtime.probe import Probe, Probes, StepContext
from nandoctor.runtime.record import Recorder, RunResult, RunStatus
from nandoctor.runtime.sentinel import Sentinel
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.step import run_step
from nandoctor.runtime.tensors import (
    host_square_sums,
    square_sums,
    stacked,
    tensor_norms,
    to_device,
)
from nandoctor.setup.session import Session


class Candidate:
    # NB: False for a candidate whose hooks cannot come off the model between its turns:
    # it steps a session of its own (and its figure carries that copy's own speed)
    shares_session = True

    def __init__(self, session: Session) -> None:
        self.session = session

    def step(self, step: int, batch: Any) -> None:
        plain_step(self.session, batch)

    def attached(self) -> contextlib.AbstractContextManager[Any]:
        """Entered around a run of consecutive steps (global hooks go on here)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


def plain_step(s: Session, batch: Any, after_backward: Callable[[], Any] | None = None) -> Any:
    """The user's loop, written out: what every other candidate is measured against.
    `after_backward` runs once the gradients are final; its result is returned."""
    batch = to_device(batch, s.device)
    s.optimizer.zero_grad(set_to_none=True)
    with s.autocast():
        loss = s.loss_fn(s.model, batch)
    if s.scaler is not None:
        s.scaler.scale(loss).backward()
        s.scaler.unscale_(s.optimizer)
    else:
        loss.backward()
    seen = after_backward() if after_backward is not None else None
    if s.scaler is not None:
        s.scaler.step(s.optimizer)
        s.scaler.update()
    else:
        s.optimizer.step()
    return seen


class _Silent(Probe):
    forward_phase = False  # NB: as the sentinel's: no hooks on the model for the phase


class Loop(Candidate):
    """nandoctor's step with a probe that does nothing: the price of the phases alone."""

    def step(self, step: int, batch: Any) -> None:
        run_step(self.session, step, batch, _Silent())


class NormFloor(Candidate):
    """The plain loop with the sentinel's pass over the gradients and nothing else (no
    probe, no phases): on the CPU each gradient's sum of squares, taken right after the
    backward and read on the host (`host_square_sums`, as the sentinel does); on CUDA
    each one's float32 norm (fused kernels; the sentinel's own CUDA pass accumulates in
    float64), unread (the sentinel's read waits a step there)."""

    def step(self, step: int, batch: Any) -> None:
        values = plain_step(self.session, batch, self._measure)
        if isinstance(values, torch.Tensor) and values.device.type == "cpu":
            values.tolist()

    def _measure(self) -> torch.Tensor | list[float] | None:
        grads = [p.grad for p in self.session.params if p.grad is not None]
        if not grads:
            return None
        if grads[0].device.type == "cuda":
            return stacked(tensor_norms(grads))
        host = host_square_sums(grads)
        return host if host is not None else stacked(square_sums(grads))


class WithSentinel(Candidate):
    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.sentinel = Sentinel(session)

    def step(self, step: int, batch: Any) -> None:
        run_step(self.session, step, batch, self.sentinel)
        for _ in self.sentinel.collect():
            pass

    def close(self) -> None:
        for _ in self.sentinel.collect(final=True):
            pass


class WithForecast(Candidate):
    """The sentinel, the precursors probe on its read, and the forecaster on the host."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.sentinel = Sentinel(session)
        self.precursors, forecaster = forecasting(self.sentinel, session)
        self.probes = Probes(self.sentinel, self.precursors)
        self.recorder = Recorder(RunResult(RunStatus.HEALTHY, 0, 0), forecaster=forecaster)

    def attached(self) -> contextlib.AbstractContextManager[Any]:
        """The probe's hooks and wrappers, on for this candidate's turn only."""
        return self.precursors

    def step(self, step: int, batch: Any) -> None:
        run_step(self.session, step, batch, self.probes)
        self.recorder.record(self.sentinel.collect())

    def close(self) -> None:
        self.recorder.record(self.sentinel.collect(final=True))


class WithSnapshots(WithSentinel):
    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.store = SnapshotStore(session)

    def step(self, step: int, batch: Any) -> None:
        self.store.before_step(step, batch)
        super().step(step, batch)


class Anomaly(Candidate):
    def step(self, step: int, batch: Any) -> None:
        # NB: per step, not for the candidate's lifetime: the mode is global (thread-local)
        # and must not slow the candidates interleaved with this one
        with torch.autograd.set_detect_anomaly(True):
            plain_step(self.session, batch)


class TransformersDebug(Candidate):
    """transformers' DebugUnderflowOverflow: forward hooks on every module, every step."""

    shares_session = False  # NB: its hooks stay on the model for good

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        from transformers.debug_utils import DebugUnderflowOverflow

        self._debug = DebugUnderflowOverflow(session.model, max_frames_to_save=21)


class WithGuard(Candidate):
    """`with Guard(model, optimizer, scaler):` around the unchanged plain loop."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.guard = Guard(session.model, session.optimizer, session.scaler)
        self.hooks: StepHooks | None = None

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        """The `with` form's hooks, on for this candidate's turn: one guard and one set of
        hooks for the whole run, as a `with guard:` around a loop keeps them (NB: leaving
        `with guard` would close the guard: its last verdict, then no more steps)."""
        if self.hooks is None:
            self.guard.__enter__()
            self.hooks = self.guard._hooked
        else:
            self.hooks.__enter__()
        try:
            yield
        finally:
            assert self.hooks is not None
            self.hooks.__exit__(None, None, None)

    def close(self) -> None:
        self.guard.close()


class GuardStep(Candidate):
    """`guard.step(fn, batch)` for each plain step: replayable, so snapshots are kept."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.guard = Guard(session.model, session.optimizer, session.scaler)

    def step(self, step: int, batch: Any) -> None:
        self.guard.step(self._train, batch)

    def _train(self, batch: Any) -> None:
        plain_step(self.session, batch)

    def close(self) -> None:
        self.guard.close()


class Watch(Candidate):
    """The watched process's driver on the plain loop: nothing given, everything found."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.run = HookedRun()
        self.sentinel = Sentinel(self.run)
        # NB: a watched process forecasts too (`watch/child.py`)
        self.precursors, forecaster = forecasting(self.sentinel, self.run)
        self.recorder = Recorder(RunResult(RunStatus.HEALTHY, 0, 0), forecaster=forecaster)
        probes = Probes(self.sentinel, self.precursors)
        self.hooks = StepHooks(self.run, probes, on_step_end=self._step_ended)

    def _step_ended(self, ctx: StepContext) -> None:
        self.recorder.record(self.sentinel.collect())

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        with self.precursors, self.hooks:
            yield


def available() -> dict[str, type[Candidate]]:
    out: dict[str, type[Candidate]] = {
        "plain": Candidate,
        "loop": Loop,
        "plain+norm": NormFloor,
        "sentinel": WithSentinel,
        "sentinel+snapshots": WithSnapshots,
        "sentinel+forecast": WithForecast,
        "guard": WithGuard,
        "guard.step": GuardStep,
        "watch": Watch,
        "anomaly": Anomaly,
    }
    try:
        import transformers.debug_utils  # noqa: F401
    except ImportError:
        pass
    else:
        out["transformers"] = TransformersDebug
    return out
