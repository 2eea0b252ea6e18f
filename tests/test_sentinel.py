"""The sentinel's rules: the first non-finite phase fails the step; a GradScaler skip is
an event until skips repeat and the scale collapses. And the one sentinel on a loop
driven from outside (the hooks' announcements): scaled gradients, several losses in a
step, a GradScaler met only mid-run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.probe import Phase, StepContext
from nandoctor.runtime.sentinel import MAX_SKIP_STREAK, Judge, Reading, Sentinel, Verdict


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


# -- the same sentinel, driven as the hooks drive it -----------------------------------
def hooked_run(scaler: torch.amp.GradScaler | None = None) -> HookedRun:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return HookedRun(model=model, device=torch.device("cpu"), scaler=scaler)


def announce(
    sentinel: Sentinel,
    run: HookedRun,
    step: int,
    losses: list[float],
    grad: float,
    grad_scale: float | None = None,
) -> list[Verdict]:
    """One step as `StepHooks` announces a user's step: a forward, loss and backward per
    micro-batch (the gradients as backward left them, still scaled), then the update."""
    ctx = StepContext(run, step, None)
    sentinel.step_started(ctx)
    for loss in losses:
        ctx.batch = (torch.ones(2, 4),)
        sentinel.phase_ended(ctx, Phase.INPUT)
        ctx.loss = torch.tensor(loss)
        sentinel.phase_ended(ctx, Phase.LOSS)
        for p in run.params:
            p.grad = torch.full_like(p, grad)
        ctx.grad_scale = torch.tensor(grad_scale) if grad_scale is not None else None
        sentinel.phase_ended(ctx, Phase.BACKWARD)
    sentinel.phase_ended(ctx, Phase.OPTIMIZER)
    sentinel.step_ended(ctx)
    return list(sentinel.collect())


def test_gradients_that_still_carry_the_loss_scale_are_measured_unscaled():
    run = hooked_run(torch.amp.GradScaler("cpu", init_scale=1024.0))
    (verdict,) = announce(Sentinel(run), run, 0, [1.0], grad=3.0 * 1024, grad_scale=1024.0)
    true_norm = 3.0 * math.sqrt(sum(p.numel() for p in run.params))
    assert verdict.reading.grad_norm == pytest.approx(true_norm)
    assert verdict.reading.scale == 1024.0 and not verdict.failed


def test_a_nonfinite_loss_is_not_overwritten_by_the_next_micro_batch():
    run = hooked_run()
    (verdict,) = announce(Sentinel(run), run, 5, [float("nan"), 2.0], grad=0.1)
    assert verdict.failed and (verdict.step, verdict.phase) == (5, Phase.LOSS)
    assert math.isnan(verdict.reading.loss)


def test_a_scaler_met_mid_run_teaches_the_judge_its_scale():
    """A user who starts at a tiny scale on purpose: a skip at 2**-10 is no collapse for
    their scaler (the judge learns its scale when the scaler first appears), although it
    would be for the judge of a run without one."""
    run = hooked_run()
    sentinel = Sentinel(run)
    (clean,) = announce(sentinel, run, 0, [1.0], grad=0.1)
    assert not clean.failed and clean.reading.scale is None
    run.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-10)  # the hooks found it
    (skip,) = announce(sentinel, run, 1, [1.0], grad=float("inf"), grad_scale=2.0**-10)
    assert skip.skipped and not skip.failed
    assert Judge()(skip.reading).failed  # a judge that never learned the scaler: collapse
