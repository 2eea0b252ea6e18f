"""Inside a watched process: `diagnose`'s sentinel on the script's own loop, through
`StepHooks`.

On the first run it watches every step (and forecasts: a forecast that fires is one line
on stderr at once, and goes in the report); at the first bad one it writes what it saw and
stops the script (`SystemExit(1)`, so the script's `finally` blocks still run), or with
`--continue` takes its hooks off and lets the script go on. On a replay run (the same
command again, `trace_step` set) it watches up to that step, runs that one step under
the tracer, writes what the tracer found and stops.

A script cannot be rewound, so the replay is the whole script run again; its pieces are
the localisation's own (`localize.replay`): the loss scale a collapse is replayed at, the
update ratio of the steps before, the tracer and the `Localization` it gives.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from nandoctor.diagnose.lr_history import LrHistory
from nandoctor.localize.reproduction import StepLoss
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.precursors import Precursors, forecasting
from nandoctor.runtime.probe import Probe, Probes, StepContext
from nandoctor.runtime.record import Recorder, RunResult, RunStatus
from nandoctor.runtime.sentinel import Sentinel
from nandoctor.runtime.verdict import Verdict
from nandoctor.watch import protocol
from nandoctor.watch.protocol import Settings
from nandoctor.watch.recheck import SkipRecheck

if TYPE_CHECKING:
    from nandoctor.localize.tracer import Tracer
    from nandoctor.localize.update import UpdateTracker
    from nandoctor.report.forecast import Forecast

_attached: WatchedProcess | None = None
UPDATE_WINDOW = 32  # on a replay, the steps before the bad one whose updates are measured


def attach(settings: Settings) -> None:
    global _attached
    if _attached is None:
        _attached = WatchedProcess(settings)


def _write_before_os_exit(at_exit: Callable[[], None]) -> None:
    """`os._exit` skips atexit: the script's own call still writes what was seen first
    (`at_exit` does nothing in another process, a forked worker)."""
    real = os._exit

    def exit_(status: int) -> NoReturn:
        with contextlib.suppress(Exception):
            at_exit()
        real(status)

    os._exit = exit_


class WatchedProcess:
    def __init__(self, settings: Settings) -> None:
        self.settings, self.pid = settings, os.getpid()
        self.run = HookedRun()
        tracing = settings.trace_step is not None
        self.sentinel = Sentinel(self.run, defer=False if tracing else None)
        self.lrs = LrHistory()  # NB: the rate each step ran with, as `diagnose` keeps it
        self.result = RunResult(RunStatus.HEALTHY, self.run.start_step, 0)
        self.recorder = Recorder(self.result)  # NB: its clock starts with the process's torch
        self.precursors: Precursors | None = None
        if not tracing and not settings.recheck_steps:  # NB: the first run forecasts
            self.precursors, forecaster = forecasting(self.sentinel, self.run)
            self.recorder = Recorder(self.result, forecaster=forecaster, on_forecast=_said)
            self.precursors.__enter__()
        self.recheck: SkipRecheck | None = None
        self.rechecked: dict[int, tuple[bool, bool]] = {}
        if settings.recheck_steps:  # a recheck run: the first run's skips, at loss scale 1
            self.recheck = SkipRecheck(self.run, settings.recheck_steps, self._rechecked)
            self.recheck.__enter__()
        probes: list[Probe] = [self.sentinel, self.lrs]
        if self.recheck is not None:
            probes.append(self.recheck)
        if self.precursors is not None:
            probes.append(self.precursors)
        self.hooks = StepHooks(
            self.run,
            Probes(*probes),
            on_step_start=self._step_started,
            on_step_end=self._step_ended,
            on_model=self._model_known,
        )
        self.hooks.__enter__()
        self.tracer: Tracer | None = None
        self.traced_loss: StepLoss | None = None  # the traced step's, as the sentinel keeps it
        self.updates: UpdateTracker | None = None
        self.note: str | None = None  # the replay's, for the report
        self.written = False
        atexit.register(self._at_exit)
        _write_before_os_exit(self._at_exit)
        protocol.attached_marker(settings.dir, self.pid).touch()

    # -- steps ----------------------------------------------------------------------------
    def _step_started(self, ctx: StepContext) -> None:
        n = self.settings.trace_step
        if n is None:
            return
        if n - UPDATE_WINDOW <= ctx.step < n:
            self._update_tracker().before()
        if ctx.step == n:
            from nandoctor.localize.replay import set_loss_scale

            if self.tracer is None:
                self._arm()  # step 0: the model became known only now
            self.note = set_loss_scale(self.run, self.settings.loss_scale)

    def _model_known(self) -> None:
        """The model's first forward, in a step that opened before it: a loop that calls
        `optimizer.step(closure)` (Lightning's, by default) opens its step at the
        optimizer, and the forward runs in the closure. What `_step_started` could not do
        without the model (measure the weights before the update, arm the tracer) starts
        now, before the forward runs."""
        n, ctx = self.settings.trace_step, self.hooks.ctx
        if n is None or ctx is None:
            return
        if n - UPDATE_WINDOW <= ctx.step < n:
            self._update_tracker().before()
        if ctx.step == n and self.tracer is None:
            self._arm()
            if self.tracer is not None:
                self.tracer.step_started(ctx)

    def _step_ended(self, ctx: StepContext) -> None:
        n = self.settings.trace_step
        if n is not None and ctx.step == n:
            self._write_trace(ctx.step, reached=True)
            self._stop()
        failure = self.recorder.record(self.sentinel.collect())
        if failure is not None:
            self._failed(failure)
            return
        if n is not None and n - UPDATE_WINDOW <= ctx.step < n:
            self._update_tracker().after(ctx.step)
        if n is not None and ctx.step == n - 1:
            self._arm()

    def _failed(self, verdict: Verdict) -> None:
        self._write_run()
        self._detach()
        if self.settings.trace_step is not None:  # the replay went wrong before its step
            self._write_trace(self.settings.trace_step, diverged=verdict.step)
            self._stop()
        if not self.settings.keep_going:
            self._stop()
        phase = verdict.phase.value if verdict.phase else "?"
        sys.stderr.write(
            f"nandoctor watch: step {verdict.step} went non-finite (phase {phase}): "
            f"{verdict.why}; the script goes on (--continue), the report comes at its end\n"
        )

    def _rechecked(self, step: int, skipped: bool, bad: bool) -> None:
        """A recheck run's answer for one skip: written at once; the run stops at the
        first skip that hid a real failure, at one this run did not skip (it is not the
        first run's: a script that is not deterministic), or after the last one."""
        self.rechecked[step] = (skipped, bad)
        protocol.write_json(
            protocol.recheck_file(self.settings.dir, self.pid),
            {"checked": [[s, *answer] for s, answer in self.rechecked.items()]},
        )
        if bad or not skipped or step >= max(self.settings.recheck_steps or [step]):
            self._detach()
            self._stop()

    # -- the tracer on the replayed step ------------------------------------------------------
    def _update_tracker(self) -> UpdateTracker:
        from nandoctor.localize.update import UpdateTracker  # NB: only a replay run needs it

        if self.updates is None:
            self.updates = UpdateTracker(self.run)
        return self.updates

    def _arm(self) -> None:
        from nandoctor.localize.tracer import Tracer  # NB: only a replay run needs it

        if self.run.model is None:
            return
        self.tracer = Tracer(self.run, others=self.run.others)
        self.tracer.__enter__()
        self.traced_loss = StepLoss(self.tracer.quiet)
        self.hooks.probe = Probes(self.tracer, self.traced_loss)

    def _write_trace(self, step: int, reached: bool = False, diverged: int | None = None) -> None:
        from nandoctor.localize.replay import Localization, localization_of

        tracer, self.tracer = self.tracer, None
        started, start = self.recorder.started, self.run.start_step
        if tracer is not None:
            tracer.__exit__(None, None, None)
            update = self.updates.latest if self.updates is not None else None
            located = localization_of(tracer, step, start, update, started, self.note)
            located.losses = self._losses(step)
        else:
            located = Localization(step, None, [], start, time.perf_counter() - started)
        data = {
            "localization": dataclasses.asdict(located),
            "reached": reached,
            "diverged": diverged,
            **protocol.job_place(),
        }
        protocol.write_json(protocol.trace_file(self.settings.dir, self.pid), data)

    def _losses(self, step: int) -> dict[int, float]:
        """The losses of this rerun, to hold against the first run's: every step the
        sentinel watched before the traced one, then the traced step's own."""
        t = self.result.telemetry
        losses = {s: loss for s, loss in zip(t.step, t.loss, strict=True) if s < step}
        traced = self.traced_loss
        if traced is not None and traced.value is not None:
            losses[step] = traced.value
        return losses

    # -- results ------------------------------------------------------------------------------
    def _write_run(self) -> None:
        from nandoctor.diagnose.facts import environment_of, facts_of

        result = self.result
        data = {
            "pid": self.pid,
            **protocol.job_place(),
            "status": result.status.value,
            "start_step": result.start_step,
            "steps_run": result.steps_run,
            "seconds": result.seconds,
            "failure": _plain(result.failure) if result.failure else None,
            "telemetry": dataclasses.asdict(result.telemetry),
            "events": [dataclasses.asdict(e) for e in result.events],
            "forecasts": [dataclasses.asdict(f) for f in result.forecasts],
            "signals": dataclasses.asdict(result.signals) if result.signals else None,
            "environment": dataclasses.asdict(environment_of(self.run)),
            "facts": dataclasses.asdict(facts_of(self.run, result, lrs=self.lrs)),
        }
        protocol.write_json(protocol.run_file(self.settings.dir, self.pid), data)
        self.written = True

    def _at_exit(self) -> None:
        if os.getpid() != self.pid or self.written:
            return
        # NB: the script died of an exception, in a step maybe: what the step saw counts
        aborted = self.hooks.abort() if hasattr(sys, "last_value") else None
        # NB: a loop with no optimizer ends its last step by ending (judged below, as the
        # process ends: nothing is stopped from here)
        self.hooks.on_step_end = None
        ended = self.hooks.finish() if aborted is None else None
        self.recorder.record(self.sentinel.collect(final=True))
        if self.result.steps_run:
            self._write_run()
        n = self.settings.trace_step
        if n is not None:
            found = self.tracer is not None and self.tracer.origin is not None
            self._write_trace(n, reached=n in (aborted, ended) and found)
        self._detach()

    def _detach(self) -> None:
        self.hooks.__exit__(None, None, None)
        if self.precursors is not None:
            self.precursors.__exit__(None, None, None)
        if self.recheck is not None:
            self.recheck.__exit__(None, None, None)

    def _stop(self) -> None:
        self.written = True
        with contextlib.suppress(OSError):
            protocol.stopped_marker(self.settings.dir, self.pid).touch()
        raise SystemExit(1)


def _plain(verdict: Verdict) -> dict[str, Any]:
    """The verdict as JSON data: the batch tensors it keeps for an input failure stay
    here, described (the report is assembled in `watch`'s own process), and so do the
    forecast's signals its reading carried."""
    from nandoctor.localize.finding import batch_finding, named_fields

    found = batch_finding(verdict)
    named = named_fields(found) if found is not None else None
    reading = dataclasses.replace(verdict.reading, carried=None)
    plain = dataclasses.replace(verdict, reading=reading, batches=[], batch_named=named)
    return dataclasses.asdict(plain)


def _said(forecast: Forecast) -> None:
    """A forecast, the moment it fires: one line on stderr (the report has it too)."""
    from nandoctor.render.forecast import warning_line  # NB: the catalog, only when needed

    sys.stderr.write(warning_line(forecast, "nandoctor watch") + "\n")
