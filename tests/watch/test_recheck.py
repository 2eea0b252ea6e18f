"""What `watch` makes of its rerun's rechecks of the GradScaler's skips at loss scale 1:
plain data in (the first run's result, the answers), the run as it truly went out."""

from __future__ import annotations

from nandoctor.report.telemetry import Event, Telemetry
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.verdict import OVERFLOW, UNCHECKED, Reading, StepOutcome, Verdict
from nandoctor.watch.recheck import steps_to_recheck, with_answers


def collapsed_run() -> RunResult:
    """Skips at 2, 5 and 8, unchecked; the scale collapsed at step 8."""
    telemetry = Telemetry()
    for step in range(9):
        skipped = step in (2, 5, 8)
        telemetry.append(step, 1.0, float("nan") if skipped else 0.5, 4.0 / 2 ** (step // 3))
    reading = Reading(8, False, False, False, False, True, False, 1.0, float("nan"), 1.0)
    collapse = Verdict(
        reading, StepOutcome.COLLAPSED, step=8, phase=Phase.BACKWARD, unchecked=True, why="collapse"
    )
    events = [Event(s, "scaler-skip", 1.0, reason=UNCHECKED) for s in (2, 5, 8)]
    return RunResult("nonfinite", 0, 9, collapse, telemetry, events)


def test_only_a_collapse_from_unchecked_skips_is_rechecked():
    run = collapsed_run()
    assert steps_to_recheck(run) == [2, 5, 8]
    assert steps_to_recheck(RunResult("healthy", 0, 9, None, run.telemetry, run.events)) == []


def test_the_first_skip_no_overflow_is_the_failure_the_run_ends_at():
    run = with_answers(collapsed_run(), {2: False, 5: True})
    failure = run.failure
    assert failure is not None and (failure.step, failure.phase, failure.hidden) == (
        5,
        Phase.BACKWARD,
        True,
    )
    assert not failure.collapsed and failure.replay_scale == 1.0  # replayed unscaled
    assert run.steps_completed == 5 and run.telemetry.step == [0, 1, 2, 3, 4, 5]
    assert [(e.step, e.reason) for e in run.events] == [(2, OVERFLOW)]


def test_skips_that_were_all_overflows_leave_the_collapse_checked():
    run = with_answers(collapsed_run(), {2: False, 5: False, 8: False})
    assert run.failure is not None and run.failure.collapsed and run.failure.step == 8
    assert run.failure.skip_reason == OVERFLOW
    assert {e.reason for e in run.events} == {OVERFLOW}
