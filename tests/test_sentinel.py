"""The sentinel's rules: the first non-finite phase fails the step; a GradScaler skip is
an event until skips repeat and the scale collapses."""

from __future__ import annotations

import pytest

from nandoctor.runtime.probe import Phase
from nandoctor.runtime.sentinel import MAX_SKIP_STREAK, Judge, Reading


def reading(step=0, scale=None, **flags) -> Reading:
    values = dict(
        params_before=False, input=False, forward=False, loss_bad=False, grads=False, params=False
    )
    values.update(flags)
    return Reading(step=step, loss=1.0, grad_norm=1.0, scale=scale, **values)


@pytest.mark.parametrize(
    ("flags", "phase"),
    [
        ({"params_before": True, "input": True}, Phase.PARAMETERS),
        ({"input": True, "forward": True, "loss_bad": True}, Phase.INPUT),
        ({"forward": True, "loss_bad": True, "grads": True}, Phase.FORWARD),
        ({"loss_bad": True, "grads": True}, Phase.LOSS),
        ({"params": True}, Phase.OPTIMIZER),
    ],
)
def test_the_earliest_flagged_phase_is_the_failure(flags, phase):
    verdict = Judge()(reading(step=7, scale=1024.0, **flags))
    assert verdict.failed and verdict.step == 7 and verdict.phase is phase


def test_bad_gradients_without_a_scaler_fail_in_backward():
    verdict = Judge()(reading(step=3, grads=True))
    assert verdict.failed and verdict.phase is Phase.BACKWARD


def test_a_scaler_skip_is_an_event_not_a_failure():
    verdict = Judge()(reading(step=3, scale=65536.0, grads=True))
    assert verdict.skipped and not verdict.failed


def test_a_nonfinite_loss_fails_even_with_a_scaler():
    verdict = Judge()(reading(step=3, scale=65536.0, loss_bad=True, grads=True))
    assert verdict.failed and verdict.phase is Phase.LOSS


def test_a_streak_of_skips_fails_at_its_first_step():
    judge = Judge()
    verdicts = [
        judge(reading(step=s, scale=2.0**60 / 2**i, grads=True))
        for i, s in enumerate(range(10, 10 + MAX_SKIP_STREAK))
    ]
    assert all(v.skipped for v in verdicts[:-1])
    assert verdicts[-1].failed and verdicts[-1].step == 10 and verdicts[-1].phase is Phase.BACKWARD
    assert f"skipped {MAX_SKIP_STREAK} steps in a row from step 10" in verdicts[-1].why


def test_a_clean_step_ends_the_streak():
    judge = Judge()
    for s in range(MAX_SKIP_STREAK - 1):
        judge(reading(step=s, scale=2.0**30, grads=True))
    judge(reading(step=99, scale=2.0**30))
    assert judge(reading(step=100, scale=2.0**30, grads=True)).skipped


def test_a_scale_falling_below_one_is_a_collapse():
    judge = Judge()
    assert judge(reading(step=1, scale=4.0, grads=True)).skipped
    assert judge(reading(step=2, scale=2.0, grads=True)).skipped
    verdict = judge(reading(step=3, scale=1.0, grads=True))
    assert verdict.failed and verdict.step == 1
