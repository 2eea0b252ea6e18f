"""The learning check of a what-if replay: finite is not enough, the run must keep learning.
Plain numbers: the losses a replay recorded, and the original run's last finite ones."""

from __future__ import annotations

import math

from nandoctor.diagnose.learning import MARGIN, MIN_GAIN, learning_of, reference_loss


def falling(start: float, end: float, n: int = 40) -> list[float]:
    return [start + (end - start) * i / (n - 1) for i in range(n)]


def test_a_falling_loss_learned():
    learning = learning_of(falling(2.3, 1.0), reference=1.4)
    assert learning.learned and learning.start > learning.end


def test_a_flat_loss_stopped_learning():
    flat = [1.386 - 0.0001 * (i % 3) for i in range(33)]  # a dead network: chance level
    learning = learning_of(flat, reference=None)
    assert not learning.learned
    assert learning.why.startswith("its loss fell by only 0.0%, from 1.39 to 1.39")


def test_a_diverging_loss_that_stays_finite_stopped_learning():
    learning = learning_of(falling(0.5, 2.0), reference=0.4)
    assert not learning.learned and learning.why == "its loss went from 0.673 up to 1.83"


def test_ending_far_above_where_the_original_run_was_is_not_learning():
    learning = learning_of(falling(5.0, 2.0), reference=1.0)  # learned, but lost its progress
    assert not learning.learned
    assert f"more than {MARGIN:.0%} above the 1 the original run had reached" in learning.why
    assert learning_of(falling(5.0, 1.0), reference=1.0).learned  # within the margin


def test_a_slow_learner_is_still_learning():
    """A 10x smaller learning rate learns slowly; over a horizon it is not "stopped"."""
    slow = falling(5.2, 5.2 * (1 - 3 * MIN_GAIN))
    assert learning_of(slow, reference=3000.0).learned


def test_noisy_batches_are_averaged_over_windows():
    noisy = [4.0 + (1.5 if i % 2 else -1.5) - 0.02 * i for i in range(60)]  # +-1.5 per batch
    assert learning_of(noisy, reference=None).learned


def test_too_few_finite_steps_to_judge_leave_the_verdict_to_finiteness():
    assert learning_of([1.0, 2.0, 3.0, math.nan], reference=0.5).learned


def test_the_reference_is_the_mean_of_the_last_finite_losses():
    assert reference_loss([9.0, 1.0, 2.0, math.inf, 3.0, 4.0, 5.0]) == 3.0
    assert reference_loss([math.nan]) is None and reference_loss([]) is None


def test_a_resumed_check_late_in_the_run_may_be_flat():
    """From a snapshot near the failure the loss is nearly flat already: a flat check that
    stays where the original was is learning; one that climbs far above it is not."""
    flat = [1.10 + 0.001 * (i % 3) for i in range(40)]
    assert not learning_of(flat, reference=1.1).learned
    assert learning_of(flat, reference=1.1, resumed=True).learned
    climbing = falling(1.1, 5.0)
    assert not learning_of(climbing, reference=1.1, resumed=True).learned
    # without the original's losses to compare with, the gain is still asked for
    assert not learning_of(flat, reference=None, resumed=True).learned


def test_a_run_that_blew_up_and_came_back_to_where_it_began_did_not_learn():
    """A 10x smaller rate that still diverges (4.17 to 1e11) and collapses to chance (a
    dead network, gradient norm 0): its loss "fell from 1.8e+05 to 4.16" from the blow-up,
    but it ends where it began."""
    dead = [4.168, 9.0, 80.0, 700.0, 8351.0, 1e6, 1e11, 2e8, 40.0] + [4.1589] * 29
    learning = learning_of(dead, reference=6e6)
    assert not learning.learned
    assert learning.why == "its loss fell by only 0.2%, from 4.17 to 4.16 (after a climb to 1e+11)"
    # risen 4x, back to chance: bfloat16 that only let a divergence run on
    bounced = [4.17, 8.0, 12.0, 15.4, 17.2, 14.0, 11.0, 12.0] + [6.0, 5.0, 4.5] * 10 + [4.3] * 8
    assert learning_of(bounced, reference=3.9).why.startswith("its loss went from 4.17 up to")


def test_a_first_loss_below_a_noisy_window_is_not_a_blow_up():
    noisy = [2.5 + (3.0 if i % 2 else 0.0) - 0.02 * i for i in range(60)]  # 2.5, 5.5, ...
    assert learning_of(noisy, reference=None).learned
