"""The report's sentences about the replay: what it saw, or why it saw nothing."""

from __future__ import annotations

from nandoctor.diagnose.summary import dead_gradients_note, long_replay_note, replay_notes
from nandoctor.localize.replay import Localization
from nandoctor.report.telemetry import Telemetry
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.verdict import Reading, StepOutcome, Verdict


def verdict(phase: Phase) -> Verdict:
    reading = Reading(4, False, False, False, True, False, False, float("nan"), 0.0, None)
    return Verdict(reading, StepOutcome.FAILED, step=4, phase=phase)


def test_a_replay_that_saw_nothing_calls_the_failure_transient():
    (note,) = replay_notes(Localization(4, None), verdict(Phase.LOSS))
    assert note.startswith(
        "the instrumented replay of step 4 saw no non-finite value: the failure did not "
        "reproduce (reproduced: not-reproduced), so it is nondeterministic or transient: a "
        "race, a fault of the hardware, or state the replay does not rewind"
    )


def test_a_replay_that_could_not_run_says_why_not_that_the_failure_is_transient():
    located = Localization(4, None, note="could not rewind: no snapshot", failed=True)
    (note,) = replay_notes(located, verdict(Phase.LOSS))
    assert note == "the instrumented replay of step 4 could not run: could not rewind: no snapshot"


def test_a_replay_that_never_reached_the_step_says_so_not_transient():
    """A rerun of a command that ended early saw nothing because it never got there."""
    located = Localization(
        4, None, note="the rerun of the command ended before step 4", reached=False
    )
    (note,) = replay_notes(located, verdict(Phase.INPUT))
    assert note == (
        "the instrumented replay did not reach step 4: the rerun of the command ended before step 4"
    )


def test_weights_broken_before_a_step_the_replay_found_finite_were_changed_outside_it():
    (note,) = replay_notes(Localization(4, None), verdict(Phase.PARAMETERS))
    assert "the weights were non-finite when step 4 began" in note
    assert "something outside the steps changed them" in note


def _run(norms: list[float]) -> RunResult:
    telemetry = Telemetry()
    for step, norm in enumerate(norms):
        telemetry.append(step, 4.16, norm, None)
    return RunResult("healthy", 0, len(norms), None, telemetry)


def test_gradients_exactly_zero_to_the_end_are_said_the_run_learns_nothing():
    (note,) = dead_gradients_note(_run([1.7, 300.0, 6e9] + [0.0] * 12))
    assert note.startswith("the gradient norm was exactly 0 from step 3 on (12 steps)")
    (note,) = dead_gradients_note(_run([0.0] * 10))
    assert note.startswith("the gradient norm was exactly 0 at every step (10 steps)")


def test_a_few_zero_gradients_or_ones_that_recover_are_no_dead_network():
    assert dead_gradients_note(_run([1.0] * 5 + [0.0] * 9)) == []  # NB: fewer than 10
    assert dead_gradients_note(_run([0.0] * 20 + [0.3])) == []
    assert dead_gradients_note(_run([1.0, float("nan")] + [0.0] * 3)) == []


def test_a_replay_of_more_than_10000_steps_from_step_0_points_to_a_checkpoint():
    (note,) = long_replay_note(RunResult("nonfinite", 0, 12_031), checkpoint=None)
    assert note.startswith("replayed 12,031 steps from step 0 to get here: for a job that fails")
    assert "point `checkpoint:` in the config at its last checkpoint before the failure" in note


def test_a_shorter_replay_or_one_from_a_checkpoint_says_nothing_of_it():
    assert long_replay_note(RunResult("nonfinite", 0, 10_000), checkpoint=None) == []
    assert long_replay_note(RunResult("healthy", 0, 40_000), checkpoint="last.pt") == []
