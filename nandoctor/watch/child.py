"""Inside a watched process: the sentinel on the script's own loop, through `StepHooks`.

On the first run it watches every step; at the first bad one it writes what it saw and
stops the script (`SystemExit(1)`, so the script's `finally` blocks still run), or with
`--continue` takes its hooks off and lets the script go on. On a replay run (the same
command again, `trace_step` set) it watches up to that step, runs that one step under
the tracer, writes what the tracer found and stops.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import time
import types
from typing import TYPE_CHECKING, Any

import torch

from nandoctor.runtime import amp
from nandoctor.runtime.hooked import Run
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.monitor import Monitor
from nandoctor.runtime.probe import Phase, Probes, StepContext
from nandoctor.runtime.sentinel import Verdict
from nandoctor.watch import protocol
from nandoctor.watch.protocol import Settings

if TYPE_CHECKING:
    from nandoctor.localize.tracer import Tracer

_attached: Watched | None = None
UPDATE_WINDOW = 32  # on a replay, the steps before the bad one whose updates are measured


def attach(settings: Settings) -> None:
    global _attached
    if _attached is None:
        _attached = Watched(settings)


class Watched:
    def __init__(self, settings: Settings) -> None:
        self.settings, self.pid = settings, os.getpid()
        self.run = Run()
        tracing = settings.trace_step is not None
        self.monitor = Monitor(self.run, defer=False if tracing else None)
        self.hooks = StepHooks(
            self.run, self.monitor, on_step_start=self._step_started, on_step_end=self._step_ended
        )
        self.hooks.__enter__()
        self.tracer: Tracer | None = None
        self.written = False
        self._before: list[torch.Tensor] | None = None
        self._update: Any = None
        self._started = time.perf_counter()
        atexit.register(self._at_exit)
        protocol.attached_marker(settings.dir, self.pid).touch()

    # -- steps ----------------------------------------------------------------------------
    def _step_started(self, ctx: StepContext) -> None:
        n = self.settings.trace_step
        if n is None:
            return
        if n - UPDATE_WINDOW <= ctx.step < n and self.run.model is not None:
            self._before = [p.detach().clone() for p in _model_params(self.run)]
        if ctx.step == n:
            if self.tracer is None:
                self._arm()  # step 0: the model became known only now
            scale, scaler = self.settings.loss_scale, self.run.scaler
            if scale is not None and scaler is not None:
                amp.set_scale(scaler, scale, self.run.device or torch.device("cpu"))

    def _step_ended(self, ctx: StepContext) -> None:
        n = self.settings.trace_step
        if n is not None and ctx.step == n:
            self._write_trace(ctx.step, reached=True)
            self._stop()
        for verdict in self.monitor.collect():
            if verdict.failed:
                self._failed(verdict)
                return
        if n is not None and n - UPDATE_WINDOW <= ctx.step < n:
            self._measure_update(ctx.step)
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

    # -- the tracer on the replayed step ------------------------------------------------------
    def _arm(self) -> None:
        from nandoctor.localize.tracer import Tracer  # NB: only a replay run needs it

        if self.run.model is None:
            return
        optimizer = self.run.optimizer or types.SimpleNamespace(state={})
        self.tracer = Tracer(self.run.model, optimizer)  # type: ignore[arg-type]
        self.tracer.__enter__()
        self.hooks.probe = _Tracing(self.tracer, self.run)

    def _measure_update(self, step: int) -> None:
        if self._before is None or self.run.model is None:
            return
        from nandoctor.localize.replay import update_ratio

        view = types.SimpleNamespace(model=self.run.model, params=_model_params(self.run))
        ratio = update_ratio(view, step, self._before)  # type: ignore[arg-type]
        self._update = ratio if ratio.ratio > 0 else self._update  # a skipped step: no move
        self._before = None

    def _write_trace(self, step: int, reached: bool = False, diverged: int | None = None) -> None:
        tracer, self.tracer = self.tracer, None
        finding, modules = None, []
        if tracer is not None:
            tracer.__exit__(None, None, None)
            finding, modules = tracer.finding, tracer.modules.stats()
        if finding is not None:
            evidence = dataclasses.replace(finding.evidence, update=self._update)
            finding = dataclasses.replace(finding, evidence=evidence)
        data = {
            "step": step,
            "finding": dataclasses.asdict(finding) if finding is not None else None,
            "modules": [dataclasses.asdict(m) for m in modules],
            "from_step": self.monitor.result.start_step,
            "seconds": time.perf_counter() - self._started,
            "reached": reached,
            "diverged": diverged,
        }
        protocol.write_json(protocol.trace_file(self.settings.dir, self.pid), data)

    # -- results ------------------------------------------------------------------------------
    def _write_run(self) -> None:
        from nandoctor.diagnose.facts import environment_of, facts_of

        result = self.monitor.result
        data = {
            "pid": self.pid,
            "status": result.status,
            "start_step": result.start_step,
            "steps_run": result.steps_run,
            "seconds": result.seconds,
            "failure": dataclasses.asdict(result.failure) if result.failure else None,
            "telemetry": dataclasses.asdict(result.telemetry),
            "events": [dataclasses.asdict(e) for e in result.events],
            "environment": dataclasses.asdict(environment_of(self.run)),
            "facts": dataclasses.asdict(facts_of(self.run, result)),
        }
        protocol.write_json(protocol.run_file(self.settings.dir, self.pid), data)
        self.written = True

    def _at_exit(self) -> None:
        if os.getpid() != self.pid or self.written:
            return
        for verdict in self.monitor.collect(final=True):
            if verdict.failed:
                break
        if self.monitor.result.steps_run:
            self._write_run()
        if self.settings.trace_step is not None:
            self._write_trace(self.settings.trace_step)
        self._detach()

    def _detach(self) -> None:
        self.hooks.__exit__(None, None, None)

    def _stop(self) -> None:
        self.written = True
        raise SystemExit(1)


class _Tracing(Probes):
    """The tracer, told the optimizer once the run has one (a step-0 replay)."""

    def __init__(self, tracer: Tracer, run: Run) -> None:
        super().__init__(tracer)
        self.tracer, self.run = tracer, run

    def phase_started(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.OPTIMIZER and self.run.optimizer is not None:
            self.tracer.optimizer = self.run.optimizer
        super().phase_started(ctx, phase)


def _model_params(run: Run) -> list[torch.nn.Parameter]:
    assert run.model is not None
    return [p for p in run.model.parameters() if p.requires_grad]
