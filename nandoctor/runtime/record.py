"""What a watched run saw, as plain data (`RunResult`), and the one place that writes the
sentinel's verdicts into it (`Recorder`), whoever drives the steps: the fast run of
`diagnose`, a `Guard`, a watched process.

Recording a verdict means: its telemetry, a GradScaler skip as an event (with its reason:
an overflow, or unchecked), the first failure, and, when the run keeps snapshots, the
snapshot of a streak of skips pinned at the streak's start (a collapse is replayed from
there) and let go when it ends. With a forecaster (`report.forecaster`), each step that
did not fail is also handed to it, with the signals the step carried
(`runtime.precursors`): a forecast that fires is an event, kept in `forecasts`, and told
to `on_forecast` (Guard's and watch's warning line).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum

from nandoctor.errors import UserCodeError
from nandoctor.report.forecast import Forecast
from nandoctor.report.forecaster import Forecaster
from nandoctor.report.signals import Curves
from nandoctor.report.telemetry import Event, Telemetry
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.verdict import Verdict

StepCallback = Callable[[Verdict], None]
ForecastCallback = Callable[[Forecast], None]


class RunStatus(str, Enum):
    """How a run ended. NB: the report's status is decided from it once
    (`diagnose.assemble.status_of`), as the plain string its value is."""

    HEALTHY = "healthy"  # every step it ran was finite (or its GradScaler skipped it)
    NONFINITE = "nonfinite"  # a step failed: `RunResult.failure`
    INTERRUPTED = "interrupted"  # Ctrl-C or SIGTERM
    TIMEOUT = "timeout"  # its time budget ran out: judged on the steps done
    ERROR = "error"  # the user's code ended it (`ended_by`; `raised`), or a peer hung


@dataclass
class RunResult:
    status: RunStatus
    start_step: int
    steps_run: int  # steps whose verdict arrived (the bad one included)
    failure: Verdict | None = None
    telemetry: Telemetry = field(default_factory=Telemetry)
    events: list[Event] = field(default_factory=list)
    seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # wall time between verdicts
    ended_by: str | None = None  # ERROR: the user's code ended the run (sys.exit)
    raised: UserCodeError | None = None  # ERROR: ...by raising this
    forecasts: list[Forecast] = field(default_factory=list)  # fired so far, best first
    signals: Curves | None = None  # the forecast's signals a step, when they were measured

    def __post_init__(self) -> None:
        self.status = RunStatus(self.status)  # NB: its value is taken too (a watched run's JSON)

    @property
    def steps_completed(self) -> int:
        """Clean optimizer steps before the first bad one (SPEC's `steps_completed`)."""
        if self.failure is not None and self.failure.step is not None:
            return self.failure.step - self.start_step
        return self.steps_run


class Recorder:
    """Writes verdicts into `result` as they arrive; its clock starts when it is made.

    `store`: the run's snapshots (may be set later: a `Guard` makes its store at the first
    `guard.step`); `on_step`: told each verdict once it is recorded (progress display).
    """

    def __init__(
        self,
        result: RunResult,
        *,
        store: SnapshotStore | None = None,
        on_step: StepCallback | None = None,
        forecaster: Forecaster | None = None,
        on_forecast: ForecastCallback | None = None,
    ) -> None:
        self.result, self.store, self.on_step = result, store, on_step
        self.forecaster, self.on_forecast = forecaster, on_forecast
        if forecaster is not None:
            result.signals = forecaster.curves
        self.started = self._last = time.perf_counter()

    def record(self, verdicts: Iterable[Verdict]) -> Verdict | None:
        """Record each verdict in turn; at the first failure, stop and return it (the
        verdicts after it are left unread: the run ends there)."""
        for verdict in verdicts:
            self._one(verdict)
            if verdict.failed:
                return verdict
        return None

    def stop(self) -> None:
        """The run is over: its time is the time since the recorder was made."""
        self.result.seconds = time.perf_counter() - self.started

    def _one(self, v: Verdict) -> None:
        r, result = v.reading, self.result
        if r.aborted and not v.failed:
            # NB: a step the script raised in (a bug, not a NaN) never finished: it is not
            # a step run, and what it left (a loss without its backward) is no telemetry
            return
        now = time.perf_counter()
        result.step_seconds.append(now - self._last)
        result.seconds, self._last = now - self.started, now
        result.steps_run += 1
        result.telemetry.append(r.step, r.loss, r.grad_norm, r.scale)
        if v.skip_reason is not None:  # NB: a collapse's last skip is one too
            result.events.append(Event(r.step, "scaler-skip", r.scale, reason=v.skip_reason))
        if self.forecaster is not None and not v.failed:
            self._forecast(v)
        if self.store is not None:
            _keep_streak_start(self.store, v)
        if self.on_step is not None:
            self.on_step(v)
        if v.failed and result.failure is None:
            result.status, result.failure = RunStatus.NONFINITE, v

    def _forecast(self, v: Verdict) -> None:
        assert self.forecaster is not None
        r, result = v.reading, self.result
        fired = self.forecaster.observe(r.step, r.loss, r.grad_norm, r.scale, v.skipped, r.carried)
        if not fired:
            return
        result.forecasts = self.forecaster.forecasts
        for forecast in fired:
            result.events.append(forecast.event())
            if self.on_forecast is not None:
                self.on_forecast(forecast)


def _keep_streak_start(store: SnapshotStore, v: Verdict) -> None:
    if v.skipped and v.streak_start == v.reading.step:
        store.pin(v.reading.step)
    elif not v.skipped and not v.failed:
        store.unpin()


__all__ = ["ForecastCallback", "Recorder", "RunResult", "RunStatus", "StepCallback"]
