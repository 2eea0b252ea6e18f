"""`Guard`: the sentinel of `diagnose` inside the user's own training loop.

Two ways to put it on, both stopping at the first bad step with `NonFiniteError`, whose
`.report` is the `Report` that `diagnose` writes::

    guard = nandoctor.Guard(model, optimizer, scaler)
    for batch in loader:
        guard.step(train_step, batch)       # train_step(batch): forward, backward, step
    guard.close()                           # the last step's verdict (one step late on CUDA)

    with nandoctor.Guard(model, optimizer, scaler):   # the loop unchanged: steps are
        for x, y in loader: ...                       # counted by optimizer steps

Both forms judge with `diagnose`'s own sentinel (`runtime.sentinel.Sentinel`, on the
hooked run: `runtime.hooked.HookedRun`) and record its verdicts the same way
(`runtime.record.Recorder`). `guard.step` can replay the bad step under the tracer with
`diagnose`'s own localisation (the report names the op, module, tensor and source line),
and recheck each GradScaler skip at loss scale 1 (a NaN the scaler skipped is the
failure, at its step); the `with` form cannot replay a loop it does not call, so its
report names the step, the phase and the trends, and its skips are unchecked.

Both forms also forecast (`runtime.precursors`, `report.forecaster`): the moment a signal's
trend is seen to cross its limit, `on_forecast` is told (by default, one
`ForecastWarning` line with the step and the steps left), and `guard.forecasts` holds
every forecast so far, best first.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from types import FrameType
from typing import Any, TypeVar

import torch

from nandoctor.diagnose.assemble import Findings, assemble
from nandoctor.diagnose.explain import causes_of
from nandoctor.diagnose.facts import environment_of, facts_of
from nandoctor.diagnose.lr_history import LrHistory
from nandoctor.errors import ExitCode, NandoctorError, UsageError, kind_of
from nandoctor.localize.replay import Localization, localize, localize_failure
from nandoctor.render.forecast import warning_line
from nandoctor.render.markdown import render_markdown
from nandoctor.report.forecast import Forecast
from nandoctor.report.types import Report
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.precursors import forecasting
from nandoctor.runtime.probe import Probe, Probes, StepContext
from nandoctor.runtime.recheck import ScaleOneRecheck
from nandoctor.runtime.record import ForecastCallback, Recorder, RunResult, RunStatus
from nandoctor.runtime.rerun import KeptStep, KeptSteps, named_batch
from nandoctor.runtime.sentinel import Sentinel
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.verdict import Verdict
from nandoctor.user_files import is_user_file

T = TypeVar("T")

HOOKED_NOTE = (
    "the guard watched the loop through hooks and could not replay the step; pass each "
    "step to guard.step(fn, batch) to have the tensor, op and source line localised"
)


def _hint(report: Report) -> str | None:
    """The top cause's fix; without a cause, the note that says how to have the tensor
    named (the `with` form replays nothing), or, the tensor named, where to look."""
    if report.causes:
        return f"{report.causes[0].id}: {report.causes[0].fix}"
    replay = next((note for note in report.notes if "replay" in note), None)
    first = report.first_nonfinite
    if replay is not None or first is None or first.op is None:
        return replay
    at = f" at {first.source}" if first.source else ""
    return (
        f"no known cause fits: {first.op}{at} made the first non-finite value; "
        "report.evidence holds its inputs and the ops that made them"
    )


class ForecastWarning(UserWarning):
    """A failure seen coming: a signal's trend crosses its limit within the horizon."""


def warn_forecast(forecast: Forecast) -> None:
    """`Guard`'s default `on_forecast`: one warning, pointed at the user's own line."""
    warnings.warn(warning_line(forecast), ForecastWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The stack level of the innermost frame of the user's code (1: none found)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and not is_user_file(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 1


class NonFiniteError(NandoctorError):
    """The first step whose values went non-finite; `.report` says where and why."""

    exit_code = ExitCode.NONFINITE

    def __init__(self, report: Report) -> None:
        super().__init__(f"non-finite values in training: {report.summary}", hint=_hint(report))
        self.report = report

    def _repr_markdown_(self) -> str:
        """Jupyter shows the report when the error is the cell's value (`err`)."""
        return render_markdown(self.report)


class Guard:
    """Watches a training loop; raises `NonFiniteError` at its first non-finite step.

    `start_step` numbers the first step (when resuming); `snapshot_every` is how many
    steps apart `guard.step` keeps the state for its replay (None: decided from the
    state's size, as `diagnose` does); `name` is what the report calls the run. With
    `raise_error=False` the first bad step only sets `guard.report` (and the guard stops
    watching): for loops that stop themselves, like the integrations. `modules`: other
    modules the step reads whose state changes from step to step (an EMA teacher, which
    `fn` updates): `guard.step`'s snapshots keep them, so a replay reads them as the step
    did (a second model the step trains, a GAN's, is met as the loop runs).
    `on_forecast`: told each forecast as it first fires (default: `warn_forecast`, one
    `ForecastWarning`); with `forecast=False` no signal is measured.
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
        recheck_skips: bool = True,
        modules: Sequence[torch.nn.Module] = (),
        forecast: bool = True,
        on_forecast: ForecastCallback | None = warn_forecast,
    ) -> None:
        _check_objects(model, optimizer, scaler)
        # NB: what the report says when the `with` form could not replay; a framework's
        # callback, with no step function to give, says what works there instead
        self.hooked_note = HOOKED_NOTE
        for module in modules:
            _check_objects(module, optimizer, scaler, name="a module in modules")
        device = next(iter(model.parameters()), torch.empty(0)).device
        enabled = scaler if scaler is not None and scaler.is_enabled() else None
        self.run = HookedRun(
            model=model,
            others=[m for m in modules if m is not model],
            given_optimizer=optimizer,
            device=device,
            scaler=enabled,
            scheduler=scheduler,
            start_step=start_step,
        )
        self.run.note_optimizer(optimizer)
        self.sentinel = Sentinel(self.run, recheck=self._recheck if recheck_skips else None)
        # the steps a GradScaler skipped that `guard.step` reran at loss scale 1 (each rerun
        # calls `fn` again for the steps since the last snapshot: see docs/api.md)
        self.rechecked: list[int] = []
        self.lrs = LrHistory()  # NB: the rate each step ran with, as `diagnose` keeps it
        self.result = RunResult(RunStatus.HEALTHY, start_step, 0)  # what the sentinel saw so far
        self.recorder = Recorder(self.result)
        probes: list[Probe] = [self.sentinel, self.lrs]
        self._precursors = None
        if forecast:  # NB: the signals ride on the sentinel's read; fired, on_forecast is told
            self._precursors, forecaster = forecasting(self.sentinel, self.run)
            self.recorder = Recorder(self.result, forecaster=forecaster, on_forecast=on_forecast)
            probes.append(self._precursors)
        self._probes = Probes(*probes)
        self._watching = False  # the precursors' hook and wrappers are on
        self.name = name  # NB: the report's `name`; its `config` is the script
        self.script = sys.argv[0] or "<python>"
        self.report: Report | None = None  # set at the first bad step
        self.snapshot_every = snapshot_every
        self.raise_error = raise_error
        self._next = start_step
        self._store: SnapshotStore | None = None
        self._hooked: StepHooks | None = None  # the `with` form's
        self._stepping: StepHooks | None = None  # `guard.step`'s
        self._carried = False  # the last call stepped no optimizer: its gradients carry on
        self._said_stepless = False

    # -- one step at a time, replayable ----------------------------------------------------
    def step(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` as one training step (forward, backward and one
        optimizer step) and return what it returns. `fn` is called again, with copies of
        the same arguments, if a step must be replayed: keep it free of side effects
        other than training (or make them harmless to repeat)."""
        if not callable(fn):
            raise UsageError(f"guard.step: the step is {kind_of(fn)}, expected a callable")
        if self.report is not None:
            return fn(*args, **kwargs)  # the guard has spoken; it no longer watches
        self._leave_hooked_mode()
        step = self._next
        store = self._snapshots()
        kept = KeptStep.of(fn, args, kwargs, reuse=store.spare_batch())
        store.before_step(step, kept, copied=True, grads=self._carried)
        hooks = self._step_hooks(step)
        self._watch_signals()  # NB: for the step alone, as its hooks: nothing left between
        try:
            with hooks:
                try:
                    ctx = hooks.begin(named_batch(args, kwargs))
                    out = fn(*args, **kwargs)
                except BaseException:
                    hooks.abandon()
                    raise
                hooks.end()
        finally:
            self._unwatch_signals()
        self._carried = not ctx.stepped
        if self._carried:
            self._stepless(step)
        self._next = step + 1
        self._judge()
        return out

    def _stepless(self, step: int) -> None:
        """A call that stepped no optimizer: its gradients carry into the next call, which
        the snapshots then keep for the replay. Said once: each call counts as a step."""
        if self._said_stepless:
            return
        self._said_stepless = True
        warnings.warn(
            f"nandoctor: guard.step's call of step {step} stepped no optimizer: each call "
            "counts as one step, so accumulate micro-batches inside one call (a call that "
            "skips its step on purpose, say on a loss spike, is fine)",
            stacklevel=3,
        )

    def _step_hooks(self, step: int) -> StepHooks:
        """The hooks of `guard.step`, one set for every step (attached during each): after
        a few steps whose only forward is the model's, they watch its calls alone, not
        every module's (NB: a new set each step never got there, and cost its set-up)."""
        hooks = self._stepping
        if hooks is None or hooks.step != step:  # NB: a step that raised counts no step
            hooks = self._stepping = StepHooks(
                self.run, self._probes, model=self.run.model, explicit=True, start_step=step
            )
        return hooks

    @property
    def forecasts(self) -> list[Forecast]:
        """Every forecast fired so far, best first."""
        return self.result.forecasts

    def _watch_signals(self) -> None:
        """The precursors' hook and wrappers go on: for each `guard.step`, or from entering
        the `with` block until the guard closes (`_unwatch_signals`)."""
        if self._precursors is not None and not self._watching:
            self._precursors.__enter__()
            self._watching = True

    def _unwatch_signals(self) -> None:
        if self._precursors is not None and self._watching:
            self._precursors.__exit__(None, None, None)
            self._watching = False

    def _recheck(self, step: int) -> bool | None:
        """A GradScaler skip, rerun at loss scale 1 through the kept steps (`guard.step`);
        the `with` form keeps none, so its skips are unchecked."""
        if self._store is None:
            return None
        self.rechecked.append(step)
        return ScaleOneRecheck(self.run, self._store, KeptSteps(self.run))(step)

    def _snapshots(self) -> SnapshotStore:
        if self._store is None:
            self._store = SnapshotStore(self.run, every=self.snapshot_every)
            self.recorder.store = self._store  # a streak of skips pins its start's snapshot
        return self._store

    # -- the loop unchanged, watched through hooks ---------------------------------------------
    def __enter__(self) -> Guard:
        if self._hooked is None and self.report is None:
            self._hooked = StepHooks(
                self.run,
                self._probes,
                model=self.run.model,
                start_step=self._next,
                on_step_end=self._hooked_step,
            )
            self._hooked.__enter__()
            self._watch_signals()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # NB: never mask the user's own exception with ours
            self._detach()

    def _repr_markdown_(self) -> str:
        """In a Jupyter cell, `guard` shows its report (Markdown), or that it is watching."""
        if self.report is not None:
            return render_markdown(self.report)
        steps = self.result.steps_completed
        return f"**nandoctor Guard**: watching; {steps} finite step{'s' * (steps != 1)} so far."

    def note_batch(self, batch: Any) -> None:
        """In the `with` form, the next step's batch as the loop holds it (labels too):
        checked as that step's input. Callbacks of frameworks call it; a plain loop needs
        not, its model's inputs are checked anyway."""
        if self._hooked is not None:
            self._hooked.name_batch(batch)

    def _hooked_step(self, ctx: StepContext) -> None:
        self._next = ctx.step + 1
        self._judge()

    def _leave_hooked_mode(self) -> None:
        """`guard.step` inside `with guard:` takes over from the hooks before any step."""
        hooked = self._hooked
        if hooked is None:
            return
        if hooked.step != self.run.start_step or hooked.ctx is not None:
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
        self._unwatch_signals()

    def _stop_watching(self) -> None:
        """The `with` form's hooks go quiet, and come off when the guard closes (NB: a
        failure is found inside the hooks' own optimizer hook, while torch loops over the
        global optimizer hooks: removing ours there breaks that loop for any after it)."""
        hooked = self._hooked
        if hooked is not None:
            hooked.probe, hooked.on_step_end = Probe(), None
        self._unwatch_signals()

    def _judge(self, final: bool = False) -> None:
        failure = self.recorder.record(self.sentinel.collect(final))
        if failure is not None:
            self._fail(failure)

    def _fail(self, verdict: Verdict) -> None:
        self._stop_watching()
        located = self._localize(verdict)
        result = self.result
        notes = [] if located is not None else [self.hooked_note]
        self.report = assemble(
            Findings(
                "guard",
                self.script,
                environment_of(self.run),
                result,
                name=self.name,
                notes=notes,
                located=located,
                causes=causes_of(result, located, facts_of(self.run, result, lrs=self.lrs)),
            )
        )
        if self.raise_error:
            raise NonFiniteError(self.report)

    def _localize(self, verdict: Verdict) -> Localization | None:
        """`diagnose`'s localisation, re-running the kept steps by calling `fn` again; the
        failure may move one step back (an update that broke the weights)."""
        store = self._store
        if store is None or verdict.step is None:
            return None
        steps = KeptSteps(self.run)
        telemetry = self.result.telemetry
        losses = dict(zip(telemetry.step, telemetry.loss, strict=True))

        def replay(step: int, loss_scale: float | None) -> Localization:
            return localize(self.run, store, step, steps, loss_scale=loss_scale, recorded=losses)

        located, failure = localize_failure(verdict, self.run.start_step, replay)
        self.result = replace(self.result, failure=failure)  # NB: it may move a step back
        return located


def _check_objects(model: Any, optimizer: Any, scaler: Any, name: str = "model") -> None:
    """One line for a wrong argument, before any hook goes on (not an AttributeError from
    deep inside the first step)."""
    wanted = (
        (name, model, torch.nn.Module, "a torch.nn.Module"),
        ("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer"),
        ("scaler", scaler, (torch.amp.GradScaler, type(None)), "a torch.amp.GradScaler or None"),
    )
    for name, value, kind, expected in wanted:
        if not isinstance(value, kind):
            raise UsageError(f"Guard: {name} is {kind_of(value)}, expected {expected}")


__all__ = ["ForecastWarning", "Guard", "NonFiniteError", "warn_forecast"]
