"""The learning check of a what-if replay: finite is not enough, the run must keep learning.
Plain numbers: the (step, loss) a replay recorded, and the original run's before its
failing step. The check is measured in the original's own units (its progress and its
step-to-step noise), so losses near 0 and below it are judged as any others."""

from __future__ import annotations

import math

import pytest

from nandoctor.diagnose.learning import (
    MARGIN,
    MIN_GAIN,
    NOISE,
    Original,
    learning_of,
    noise_of,
    reference_loss,
)


def falling(start: float, end: float, n: int = 40) -> list[float]:
    return [start + (end - start) * i / (n - 1) for i in range(n)]


def steps(losses: list[float], first: int = 0) -> list[tuple[int, float]]:
    return list(enumerate(losses, start=first))


def wiggle(losses: list[float], amplitude: float) -> list[float]:
    """Batch noise: each loss off by up to `amplitude`, in a pattern that never repeats
    soon (no trend of its own)."""
    return [x + amplitude * math.sin(1.7 * i * i) for i, x in enumerate(losses)]


def original(start: float, end: float, n: int = 40, amplitude: float = 0.0):
    """An original run that fell from `start` to `end` over `n` steps before failing."""
    return steps(wiggle(falling(start, end, n), amplitude))


def test_a_falling_loss_learned():
    learning = learning_of(steps(falling(2.3, 1.0)), original(2.3, 1.4))
    assert learning.learned and learning.start > learning.end


def test_a_flat_loss_stopped_learning():
    flat = [1.386 - 0.0001 * (i % 3) for i in range(33)]  # a dead network: chance level
    learning = learning_of(steps(flat, first=150), [])
    assert not learning.learned
    assert learning.why.startswith("its loss fell by only 0.0%, from 1.39 to 1.39")


def test_a_diverging_loss_that_stays_finite_stopped_learning():
    learning = learning_of(steps(falling(0.5, 2.0)), [])
    assert not learning.learned and learning.why == "its loss went from 0.673 up to 1.83"


def test_ending_behind_by_more_than_half_the_originals_progress_is_not_learning():
    """The original fell from 5 to 1: a check that falls to 3.5 gave back more than half
    of that progress (learned at first, then lost it); one that reaches 2.5 did not."""
    before = original(5.0, 1.0, n=40, amplitude=0.05)
    lost = learning_of(steps(falling(5.0, 3.5)), before)
    assert not lost.learned
    assert lost.why == (
        "its loss ended at 3.67, 2.48 above the 1.2 the original run had reached before "
        "failing: more than half the original's progress (4.55 down to 1.2) plus twice its "
        "step-to-step noise (0.058)"
    )
    assert learning_of(steps(falling(5.0, 2.5)), before).learned


def test_a_slow_learner_is_still_learning():
    """A 10x smaller learning rate learns slowly; over a horizon it is not "stopped"."""
    slow = falling(5.2, 5.2 * (1 - 3 * MIN_GAIN))
    assert learning_of(steps(slow), original(5.2, 3000.0, n=20)).learned


def test_noisy_batches_are_averaged_over_windows():
    noisy = [4.0 + (1.5 if i % 2 else -1.5) - 0.02 * i for i in range(60)]  # +-1.5 per batch
    assert learning_of(steps(noisy), []).learned


def test_too_few_finite_steps_to_judge_leave_the_verdict_to_finiteness():
    assert learning_of(steps([1.0, 2.0, 3.0, math.nan]), original(3.0, 0.5)).learned


def test_the_reference_is_the_mean_of_the_last_finite_losses():
    assert reference_loss(steps([9.0, 1.0, 2.0, math.inf, 3.0, 4.0, 5.0])) == 3.0
    assert reference_loss(steps([math.nan])) is None and reference_loss([]) is None


def test_a_resumed_check_late_in_the_run_may_be_flat():
    """From a snapshot near the failure the loss is nearly flat already: a flat check that
    stays where the original was is learning; one that climbs far above it is not."""
    before = steps(wiggle(falling(2.3, 1.1, 40) + [1.1] * 20, 0.01))
    flat = steps([1.10 + 0.001 * (i % 3) for i in range(40)], first=40)
    assert not learning_of(flat, before).learned
    assert learning_of(flat, before, resumed=True).learned
    climbing = steps(falling(1.1, 5.0), first=40)
    assert not learning_of(climbing, before, resumed=True).learned
    # without the original's losses to compare with, the gain is still asked for
    assert not learning_of(flat, [], resumed=True).learned


def test_a_run_that_blew_up_and_came_back_to_where_it_began_did_not_learn():
    """A 10x smaller rate that still diverges (4.17 to 1e11) and collapses to chance (a
    dead network, gradient norm 0): its loss "fell from 1.8e+05 to 4.16" from the blow-up,
    but it ends where it began."""
    dead = [4.168, 9.0, 80.0, 700.0, 8351.0, 1e6, 1e11, 2e8, 40.0] + [4.1589] * 29
    diverged = steps([4.168, 3.9, 3.7, 3.6, 8.0, 90.0, 1e3, 6e4, 2e6, 6e6, 7e6])
    learning = learning_of(steps(dead), diverged)
    assert not learning.learned
    assert learning.why == "its loss fell by only 0.2%, from 4.17 to 4.16 (after a climb to 1e+11)"
    # risen 4x, back to chance: bfloat16 that only let a divergence run on
    bounced = [4.17, 8.0, 12.0, 15.4, 17.2, 14.0, 11.0, 12.0] + [6.0, 5.0, 4.5] * 10 + [4.3] * 8
    assert learning_of(steps(bounced), []).why.startswith("its loss went from 4.17 up to")


def test_a_first_loss_below_a_noisy_window_is_not_a_blow_up():
    noisy = [2.5 + (3.0 if i % 2 else 0.0) - 0.02 * i for i in range(60)]  # 2.5, 5.5, ...
    assert learning_of(steps(noisy), []).learned


# -- any loss: near 0, negative, flat at its end ----------------------------------------
def test_a_loss_near_zero_is_judged_by_the_progress_it_made_not_by_a_ratio():
    """The original fell from 1.84 to 0.00124; the fix's check, resumed late, ended at
    0.00288. That was "more than 50% above 0.00124"; it gave back 0.1% of the way the
    original came."""
    before = steps(wiggle([1.84 * math.exp(-i / 5) + 0.0012 for i in range(61)], 0.0002))
    check = steps(wiggle([0.0029] * 62, 0.0004), first=32)
    assert learning_of(check, before, resumed=True).learned
    assert learning_of(steps(falling(1.84, 0.0029, 94)), before).learned  # from the start


def test_a_negative_loss_is_judged_by_the_progress_it_made_not_by_a_ratio():
    """A Gaussian's negative log-likelihood fell from 1.0 to -0.402; a 10x smaller rate
    from the start ended at -0.111. That was "more than 50% above -0.402"; it kept 79% of
    the original's progress. A check that climbed back to 0.9 did lose it: it ended 1.1
    above where the original had got, of a progress of 1.19 (0.835 down to -0.35)."""
    before = steps(wiggle(falling(1.0, -0.402, 60), 0.03))
    assert learning_of(steps(wiggle(falling(1.0, -0.111, 92), 0.03)), before).learned
    climbed = learning_of(steps(falling(-0.4, 0.9, 40), first=40), before, resumed=True)
    assert not climbed.learned
    assert climbed.why.startswith(
        "its loss ended at 0.75, 1.1 above the -0.35 the original run had reached before "
        "failing: more than half the original's progress (0.835 down to -0.35)"
    )


def test_a_loss_that_ends_flat_is_judged_by_where_it_got():
    """A run that converged early sits on its plateau (0.0021 +- batch noise) when it
    fails: a check resumed there, flat on the same plateau, is learning, and so is a
    check from the start that falls to it and stays."""
    curve = [2.0 * math.exp(-i / 3) + 0.002 for i in range(80)]
    before = steps(wiggle(curve, 0.0003))
    plateau = steps(wiggle([0.0034] * 40, 0.0003), first=64)
    assert learning_of(plateau, before, resumed=True).learned
    assert learning_of(steps(wiggle(curve + [0.0034] * 32, 0.0003)), before).learned


def test_the_originals_noise_widens_the_margin():
    """A noisy original (batches +-0.3 around its trend) allows an end within twice its
    noise beyond half its progress: a ratio of two window means would have read noise."""
    before = steps(wiggle(falling(0.55, 0.08, 41), 0.3))
    yardstick = Original.of(before)
    assert yardstick.noise == pytest.approx(noise_of([x for _, x in before]))
    allowed = MARGIN * yardstick.progress + NOISE * yardstick.noise
    assert allowed > 0.3
    near = steps(wiggle([yardstick.reached + 0.25] * 40, 0.3), first=32)
    assert learning_of(near, before, resumed=True).learned
    far = steps([2.3] * 40, first=32)
    assert not learning_of(far, before, resumed=True).learned


def test_a_steady_fall_is_no_noise():
    assert noise_of(falling(5.0, 1.0)) == pytest.approx(0.0, abs=1e-12)
    assert noise_of([1.0, 2.0]) == 0.0
    assert noise_of(wiggle([1.0] * 200, 0.1)) > 0.05
