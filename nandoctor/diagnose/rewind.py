"""Whether a fix refuted from the snapshot is replayed again from the run's start, and who
hears of each replay as it starts (`Rewind`).

A fix is replayed from the newest snapshot before the failure (diagnose/verify.py). Where
it is refuted there, a replay from the run's start (step 0, or the checkpoint's) can only
say more when the fix changes what happened *before* the snapshot: a learning rate, a
clip, a dtype change every update of the weights' whole trajectory (`plans.Reach`). A
rewrite of the failing op, a raised eps or a skipped batch acts at the failing step,
which the snapshot's replay ran with the fix: its refutation there is conclusive.

A replay from the start costs the run again, so it is made only where it fits the budget
of the stages after the run (`budget_after`): all of them (the replay of the bad step,
the fixes' replays, this one) within `REWIND_SHARE` (half) of the run's own time, so
that a verified diagnosis takes at most 1.5x the run's time to the failing step. Its cost
is estimated from the run's own step time (the median) times the steps it replays. Such a
replay runs every step to the failure and a quarter more: it costs the run again, so the
share alone would rule it out wherever the run took long enough to matter. A short one
is made all the same (`REWIND_FLOOR_STEPS` steps at most, or `REWIND_FLOOR` seconds at
the run's pace): a few seconds buy a conclusive verdict (NB: the steps, unlike the
seconds, do not move with the machine's load, so a short run's report does not either).
Where a fix is not replayed from the start, its sentence says it was refuted from the
snapshot's step and offers `--verify-from-start` (`always`), which replays every refuted
fix from the start (within `--verify-budget` still).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from nandoctor.diagnose.budgets import REWIND_FLOOR, REWIND_FLOOR_STEPS, REWIND_SHARE
from nandoctor.diagnose.plans import Plan, Reach
from nandoctor.runtime.fast_run import StepCallback
from nandoctor.runtime.record import RunResult

FROM_START_OPTION = "--verify-from-start"


@dataclass(frozen=True)
class Replaying:
    """A fix's replay as it starts: whose fix, which, and over which steps."""

    cause: str
    describe: str
    start: int
    target: int
    resumed: bool


@dataclass(frozen=True)
class Rewind:
    """How refuted fixes are replayed from the start: by when such a replay must end
    (`by`, a `time.perf_counter()`), at what step time, or `always`, and what replay is
    short enough to be made all the same (`short`); and the callbacks that show each
    replay (`on_replay`) and its steps (`on_step`)."""

    by: float = float("inf")
    step_seconds: float | None = None  # the run's own; None: measured on the resumed replay
    always: bool = False  # --verify-from-start
    short: tuple[int, float] = (REWIND_FLOOR_STEPS, REWIND_FLOOR)  # steps, seconds
    on_replay: Callable[[Replaying], None] | None = None
    on_step: StepCallback | None = None
    cause: str = ""  # whose fixes these are (`of`)

    def of(self, cause: str) -> Rewind:
        return replace(self, cause=cause)

    def started(self, plan: Plan, start: int, target: int, resumed: bool) -> None:
        if self.on_replay is not None:
            self.on_replay(Replaying(self.cause, plan.describe, start, target, resumed))

    def why_not(
        self, plan: Plan, start: int, steps: int, per_step: float, end: float
    ) -> str | None:
        """Why the fix, refuted from the snapshot, is not replayed from `start` (`steps`
        steps, `per_step` seconds each; `end`: the verification's own deadline), as the
        clause after "refuted from step N"; None: it is."""
        if self.always:
            return None
        if plan.reach is not Reach.HISTORY:
            return (
                f": the fix acts at the failing step, so a replay from step {start} would "
                f"show no more ({FROM_START_OPTION} replays it from there)"
            )
        cost, now = per_step * steps, time.perf_counter()
        whole = f" only: a replay from step {start} ({steps:,} steps) would not fit"
        if now + cost > end:
            return f"{whole} --verify-budget ({FROM_START_OPTION} with a larger one replays it)"
        short = steps <= self.short[0] or cost <= self.short[1]
        if not short and now + cost > self.by:
            return f"{whole} the time budget ({FROM_START_OPTION} replays it)"
        return None


def budget_after(result: RunResult, run_ended: float) -> float:
    """By when the stages after the run must be done for a verified diagnosis to take at
    most 1 + `REWIND_SHARE` times the run's own time."""
    return run_ended + REWIND_SHARE * result.seconds


def step_seconds(result: RunResult) -> float | None:
    """The run's step time: the median of its steps' (the first, warming up, aside)."""
    return statistics.median(result.step_seconds) if result.step_seconds else None
