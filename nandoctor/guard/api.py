"""`Guard`: the sentinel of `diagnose` inside the user's own training loop.

Two ways to put it on, both stopping at the first bad step with `NonFiniteError`, whose
`.report` is the `Report` that `diagnose` writes::

    guard = nandoctor.Guard(model, optimizer, scaler)
    for batch in loader:
        guard.step(train_step, batch)       # train_step(batch): forward, backward, step
    guard.close()                           # the last step's verdict (one step late on CUDA)

    with nandoctor.Guard(model, optimizer, scaler):   # the loop unchanged: steps are
        for x, y in loader: ...                       # counted by optimizer steps

`guard.step` can replay the bad step under the tracer (the report names the op, module,
tensor and source line); the `with` form cannot replay a loop it does not call, so its
report names the step, the phase and the trends.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from nandoctor.diagnose.facts import environment_of, facts_of
from nandoctor.diagnose.reporting import build_report
from nandoctor.errors import ExitCode, NandoctorError, UsageError
from nandoctor.localize.guarded import KeptStep, TrainState, localize_step, named_batch
from nandoctor.localize.replay import Localization
from nandoctor.report.types import Report
from nandoctor.runtime.hooked import Run
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.monitor import Monitor
from nandoctor.runtime.probe import Phase, StepContext
from nandoctor.runtime.sentinel import Verdict
from nandoctor.runtime.snapshot import SnapshotStore

T = TypeVar("T")

HOOKED_NOTE = (
    "the guard watched the loop through hooks and could not replay the step; pass each "
    "step to guard.step(fn, batch) to have the tensor, op and source line localised"
)


class NonFiniteError(NandoctorError):
    """The first step whose values went non-finite; `.report` says where and why."""

    exit_code = ExitCode.NONFINITE

    def __init__(self, report: Report) -> None:
        top = report.causes[0] if report.causes else None
        hint = f"{top.id}: {top.fix}" if top is not None else None
        super().__init__(f"non-finite values in training: {report.summary}", hint=hint)
        self.report = report


class Guard:
    """Watches a training loop; raises `NonFiniteError` at its first non-finite step.

    `start_step` numbers the first step (when resuming); `snapshot_every` is how many
    steps apart `guard.step` keeps the state for its replay (None: decided from the
    state's size, as `diagnose` does); `name` is what the report calls the run. With
    `raise_error=False` the first bad step only sets `guard.report` (and the guard stops
    watching): for loops that stop themselves, like the integrations.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
        *,
        scheduler: Any | None = None,
        start_step: int = 0,
        snapshot_every: int | None = None,
        name: str | None = None,
        raise_error: bool = True,
    ) -> None:
        device = next(iter(model.parameters()), torch.empty(0)).device
        enabled = scaler if scaler is not None and scaler.is_enabled() else None
        self.run = Run(model=model, device=device, scaler=enabled)
        self.run.note_optimizer(optimizer)
        self.state = TrainState(model, optimizer, scaler, scheduler, device, start_step)
        self.monitor = Monitor(self.run, start_step=start_step)
        self.name = name if name is not None else (sys.argv[0] or "<python>")
        self.report: Report | None = None  # set at the first bad step
        self.snapshot_every = snapshot_every
        self.raise_error = raise_error
        self._next = start_step
        self._store: SnapshotStore | None = None
        self._hooked: StepHooks | None = None

    # -- one step at a time, replayable ----------------------------------------------------
    def step(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` as one training step (forward, backward and one
        optimizer step) and return what it returns. `fn` is called again, with copies of
        the same arguments, if a step must be replayed: keep it free of side effects
        other than training (or make them harmless to repeat)."""
        if self.report is not None:
            return fn(*args, **kwargs)  # the guard has spoken; it no longer watches
        self._leave_hooked_mode()
        step = self._next
        self._snapshots().before_step(step, KeptStep.of(fn, args, kwargs))
        hooks = StepHooks(
            self.run, self.monitor, model=self.state.model, explicit=True, start_step=step
        )
        with hooks:
            try:
                hooks.begin(named_batch(args, kwargs))
                out = fn(*args, **kwargs)
            except BaseException:
                hooks.abandon()
                raise
            hooks.end()
        self._next = step + 1
        self._judge()
        return out

    def _snapshots(self) -> SnapshotStore:
        if self._store is None:
            self._store = SnapshotStore(self.state, every=self.snapshot_every)  # type: ignore[arg-type]
        return self._store

    # -- the loop unchanged, watched through hooks ---------------------------------------------
    def __enter__(self) -> Guard:
        if self._hooked is None and self.report is None:
            self._hooked = StepHooks(
                self.run,
                self.monitor,
                model=self.state.model,
                start_step=self._next,
                on_step_end=self._hooked_step,
            )
            self._hooked.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # NB: never mask the user's own exception with ours
            self._detach()

    def _hooked_step(self, ctx: StepContext) -> None:
        self._next = ctx.step + 1
        self._judge()

    def _leave_hooked_mode(self) -> None:
        """`guard.step` inside `with guard:` takes over from the hooks before any step."""
        hooked = self._hooked
        if hooked is None:
            return
        if hooked.step != self.state.start_step or hooked.ctx is not None:
            raise UsageError(
                "guard.step() called inside a loop the guard already watches through hooks",
                hint="use either guard.step(fn, batch) for every step or the `with` form alone",
            )
        self._detach()

    # -- verdicts ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop watching; judge the steps whose verdicts are still pending (CUDA)."""
        self._detach()
        if self.report is None:
            self._judge(final=True)

    def _detach(self) -> None:
        if self._hooked is not None:
            hooked, self._hooked = self._hooked, None
            hooked.__exit__(None, None, None)

    def _judge(self, final: bool = False) -> None:
        for verdict in self.monitor.collect(final):
            self._keep_streak_start(verdict)
            if verdict.failed:
                self._fail(verdict)
                return

    def _keep_streak_start(self, v: Verdict) -> None:
        if self._store is None:
            return
        if v.skipped and v.streak_start == v.reading.step:
            self._store.pin(v.reading.step)
        elif not v.skipped and not v.failed:
            self._store.unpin()

    def _fail(self, verdict: Verdict) -> None:
        self._detach()
        located = self._localize(verdict)
        result = self.monitor.result
        notes = [] if located is not None else [HOOKED_NOTE]
        self.report = build_report(
            "guard",
            self.name,
            environment_of(self.run),
            facts_of(self.run, result),
            result,
            located,
            notes,
        )
        if self.raise_error:
            raise NonFiniteError(self.report)

    def _localize(self, verdict: Verdict) -> Localization | None:
        if self._store is None or verdict.step is None:
            return None
        collapsed = verdict.phase is Phase.BACKWARD and verdict.reading.scale is not None
        scale = verdict.reading.scale if collapsed else None
        return localize_step(self.state, self._store, verdict.step, loss_scale=scale)


__all__ = ["Guard", "NonFiniteError"]
