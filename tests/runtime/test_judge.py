"""A step's outcome, as the judge moves through a run (`StepOutcome`), on real float16 loops
with a GradScaler("cpu"): a skip rechecked finite at loss scale 1 is an overflow; one
non-finite there too is the failure the scaler hid; skips nothing can recheck stay
unchecked, and in a row they collapse the scale, a failure at the streak's first step;
a finite step ends the streak. A failure a replay moves back to the update before it is
no collapse there. Each outcome is read from the verdicts as `Guard` records them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nandoctor.guard import Guard
from nandoctor.runtime.judge import MAX_SKIP_STREAK, Judge
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.verdict import OVERFLOW, UNCHECKED, Reading, StepOutcome, Verdict

FINITE, FAILED, HIDDEN, COLLAPSED = (
    StepOutcome.FINITE,
    StepOutcome.FAILED,
    StepOutcome.HIDDEN,
    StepOutcome.COLLAPSED,
)
OVERFLOWED, UNCHECKED_SKIP = StepOutcome.SKIPPED_OVERFLOW, StepOutcome.SKIPPED_UNCHECKED


def fp16_loop(steps: int, init_scale: float, sqrt_at_zero: bool = False):
    """A classifier under float16 autocast with a GradScaler; at 2**24 its first steps
    overflow. `sqrt_at_zero` adds a term whose gradient is NaN at any scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    g = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))
        for _ in range(steps)
    ]

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
            loss = F.cross_entropy(out, y)
        if sqrt_at_zero:
            loss = loss + torch.sqrt(((out - out.detach()).float() ** 2).sum())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    return Guard(model, optimizer, scaler, forecast=False, raise_error=False), batches, train_step


def stepped(guard: Guard, train_step, batches) -> list[Verdict]:
    """Every verdict `guard.step` recorded: it reruns each skip at loss scale 1."""
    seen: list[Verdict] = []
    guard.recorder.on_step = seen.append
    for batch in batches:
        guard.step(train_step, batch)
    return seen


def hooked(guard: Guard, train_step, batches) -> list[Verdict]:
    """Every verdict the `with` form recorded: it cannot rerun a step of the loop."""
    seen: list[Verdict] = []
    guard.recorder.on_step = seen.append
    with guard:
        for batch in batches:
            train_step(batch)
    return seen


def test_a_skip_rechecked_finite_is_an_overflow_and_a_finite_step_ends_the_streak():
    guard, batches, train_step = fp16_loop(steps=12, init_scale=2.0**24)
    seen = stepped(guard, train_step, batches)
    outcomes = [v.outcome for v in seen]
    skips = outcomes.index(FINITE)
    assert skips >= 2 and outcomes == [OVERFLOWED] * skips + [FINITE] * (12 - skips)
    assert [v.streak_start for v in seen[:skips]] == [0] * skips  # one streak, from step 0
    assert {v.skip_reason for v in seen[:skips]} == {OVERFLOW}
    assert not any(v.failed for v in seen) and guard.report is None


def test_a_skip_nothing_can_recheck_is_unchecked():
    guard, batches, train_step = fp16_loop(steps=12, init_scale=2.0**24)
    outcomes = [v.outcome for v in hooked(guard, train_step, batches)]
    skips = outcomes.index(FINITE)
    assert skips >= 2 and outcomes == [UNCHECKED_SKIP] * skips + [FINITE] * (12 - skips)


def test_a_skip_rechecked_non_finite_is_the_failure_the_scaler_hid():
    guard, batches, train_step = fp16_loop(steps=4, init_scale=2.0**16, sqrt_at_zero=True)
    (verdict,) = stepped(guard, train_step, batches)  # the first failure ends the run
    assert verdict.outcome is HIDDEN and (verdict.step, verdict.phase) == (0, Phase.BACKWARD)
    assert verdict.failed and not verdict.collapsed and verdict.skip_reason is None
    assert verdict.replay_scale == 1.0  # replayed unscaled: no overflow hides the origin
    assert guard.result.failure is not None and guard.result.failure.outcome is HIDDEN


def test_unchecked_skips_in_a_row_collapse_the_scale_at_the_streaks_first_step():
    guard, batches, train_step = fp16_loop(
        steps=MAX_SKIP_STREAK + 2, init_scale=2.0**16, sqrt_at_zero=True
    )
    seen = hooked(guard, train_step, batches)
    outcomes = [v.outcome for v in seen]
    assert outcomes == [UNCHECKED_SKIP] * (MAX_SKIP_STREAK - 1) + [COLLAPSED]
    collapse = seen[-1]
    assert (collapse.step, collapse.phase) == (0, Phase.BACKWARD)  # where the streak began
    assert collapse.reading.step == MAX_SKIP_STREAK - 1 and collapse.collapsed_unchecked
    assert collapse.skip_reason == UNCHECKED  # its own skip is an event too
    assert collapse.replay_scale == collapse.reading.scale  # the scale the streak fell to


def test_a_float32_step_that_goes_non_finite_fails_where_it_began():
    """No GradScaler to skip it: the batch's NaN reaches the loss, and the step fails."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 8), torch.randint(0, 3, (8,))) for _ in range(3)]
    batches[1][0][2, 5] = float("nan")

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    guard = Guard(model, optimizer, forecast=False, raise_error=False)
    seen = stepped(guard, train_step, batches)
    assert [v.outcome for v in seen] == [FINITE, FAILED]
    assert (seen[-1].step, seen[-1].phase) == (1, Phase.INPUT)


@pytest.mark.parametrize(
    ("outcome", "after"), [(COLLAPSED, FAILED), (HIDDEN, HIDDEN), (FAILED, FAILED)]
)
def test_a_failure_moved_back_to_the_update_before_it_is_no_collapse(outcome, after):
    """The replay met weights broken before the failing step, and the step before it
    broke them in its update: that update is the failure, not a streak of skips (one the
    scaler hid is still replayed at loss scale 1)."""
    reading = Reading(9, False, False, False, False, True, False, 1.0, 1.0, scale=4.0)
    failure = Verdict(reading, outcome, step=9, phase=Phase.BACKWARD, unchecked=True)
    moved = failure.blamed_on_update("the optimizer's update made parameters non-finite")
    assert moved.outcome is after and (moved.step, moved.phase) == (8, Phase.OPTIMIZER)
    assert not moved.collapsed and not moved.collapsed_unchecked
    assert failure.outcome is outcome and failure.step == 9  # the verdict it came from stays


def test_a_judge_that_meets_no_failure_says_finite():
    verdict = Judge()(Reading(0, False, False, False, False, False, False, 1.0, 1.0, scale=None))
    assert verdict.outcome is FINITE and not verdict.failed and not verdict.skipped
    with pytest.raises(ValueError, match="no step to move back"):
        verdict.blamed_on_update("")
