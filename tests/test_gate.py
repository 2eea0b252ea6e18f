"""The baseline gate fails on a numeric regression and names where it starts."""

from __future__ import annotations

from dataclasses import replace

from nandoctor.gate.check import Tolerances, compare_to_baseline, headroom_check
from nandoctor.report.health import GradNorms, Health, ModuleHealth


def health(scale=1.0, p90=1.0, streak=3, loss=0.5, headroom=0.1) -> Health:
    modules = [
        ModuleHealth("", "Sequential", 8.0 * scale, 1.0, order=3),
        ModuleHealth("0", "Linear", 4.0, 1.0, order=0),
        ModuleHealth("1", "ReLU", 4.0, 1.0, order=1),
        ModuleHealth("2", "Linear", 8.0 * scale, 1.0, order=2),
    ]
    return Health(100, loss, GradNorms(0.5, p90, 2.0, 3.0), streak, streak, headroom, "2", modules)


def failed(gate):
    return {c.name: c.message for c in gate.checks if not c.passed}


def test_the_same_health_passes_every_check():
    gate = compare_to_baseline(health(), health(), "b.json", Tolerances())
    assert gate.passed and len(gate.checks) == 5


def test_doubled_activations_name_the_first_module_that_grew():
    gate = compare_to_baseline(health(scale=2.0), health(), "b.json", Tolerances())
    message = "2 (Linear) activations peaked at 16, 2.0x the baseline's 8 (limit 1.5x) (and 1 more)"
    assert failed(gate) == {"activation growth": message}


def test_gradient_norm_growth():
    gate = compare_to_baseline(health(p90=2.5), health(), "b.json", Tolerances())
    assert (
        "p90 gradient norm 2.5, 2.50x the baseline's 1 (limit 2x)" in failed(gate)["gradient norm"]
    )


def test_a_new_streak_of_scaler_skips():
    gate = compare_to_baseline(health(streak=6), health(streak=3), "b.json", Tolerances())
    assert (
        failed(gate)["scaler skips"] == "longest streak of GradScaler skips 6 (baseline 3, limit 5)"
    )


def test_a_worse_final_loss():
    gate = compare_to_baseline(health(loss=0.6), health(loss=0.5), "b.json", Tolerances())
    assert failed(gate)["final loss"] == "final loss 0.6 (baseline 0.5, limit 0.55)"
    assert compare_to_baseline(
        health(loss=0.6), health(loss=0.5), "b", Tolerances(max_loss_increase=0.3)
    ).passed


def test_every_tolerance_can_be_loosened():
    loose = Tolerances(max_activation_growth=3.0)
    assert compare_to_baseline(health(scale=2.0), health(), "b.json", loose).passed


def test_headroom_limit():
    check = headroom_check(replace(health(), headroom=0.93), 0.5)
    assert not check.passed and check.message == "peak at 93% of float16's 65504 in 2 (limit 50%)"
