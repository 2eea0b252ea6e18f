"""The baseline gate fails on lost numeric headroom and names where it starts; changes of
dynamics (other seeds, learning rates) are not regressions unless asked for."""

from __future__ import annotations

from dataclasses import replace

from nandoctor.gate.check import Tolerances, compare_to_baseline, gate_of, headroom_check
from nandoctor.report.health import GradNorms, Health, ModuleHealth

OPT_IN = Tolerances(max_activation_growth=1.5, max_gradient_growth=2.0, max_loss_increase=0.1)


def health(scale=1.0, p90=1.0, streak=3, loss=0.5, headroom=0.1, level=8.0, grad=1.0) -> Health:
    """Four modules; `level` is the peak activation (of "2" and the root), `scale` grows it."""
    modules = [
        ModuleHealth("", "Sequential", level * scale, grad, order=3),
        ModuleHealth("0", "Linear", 4.0, grad, order=0),
        ModuleHealth("1", "ReLU", 4.0, grad, order=1),
        ModuleHealth("2", "Linear", level * scale, grad, order=2),
    ]
    return Health(100, loss, GradNorms(0.5, p90, 2.0, 3.0), streak, streak, headroom, "2", modules)


def failed(gate):
    return {c.name: c.message for c in gate.checks if not c.passed}


def test_the_same_health_passes_every_check():
    gate = compare_to_baseline(health(), health(), "b.json", Tolerances())
    assert gate.passed and [c.name for c in gate.checks] == ["headroom loss", "scaler skips"]


def test_a_pass_says_which_modules_it_could_not_compare():
    """A model that gained or lost layers is gated on the rest: the pass says so."""
    grown = health()
    grown.modules.append(ModuleHealth("3", "Linear", 4.0, 1.0, order=4))
    lost = replace(health(), modules=health().modules[:2])
    gate = compare_to_baseline(grown, lost, "b.json", Tolerances(), "float16")
    (check,) = [c for c in gate.checks if c.name == "headroom loss"]
    assert check.passed and check.message.endswith(
        "grew past 1.5x the baseline's (3 of this run's modules not in the baseline: "
        "re-record the baseline to gate them)"
    )
    gate = compare_to_baseline(lost, health(), "b.json", Tolerances(), "float16")
    assert "(2 of the baseline's not in this run: re-record" in gate.checks[0].message
    same = compare_to_baseline(health(), health(), "b.json", Tolerances(), "float16")
    assert same.checks[0].message.endswith("the baseline's")


def test_a_layer_inserted_into_a_sequential_is_not_gated_as_the_one_whose_path_it_took():
    """A Linear inserted at "2" took the old head's path and type: its peak of 2001 was
    compared with the head's 1501 (1.33x, a pass). Its size tells it apart: not in the
    baseline, its peak above 1/64 of float16's range fails."""

    def sized(h: Health, params: int) -> Health:
        return replace(h, modules=[replace(m, params=params if m.module == "2" else 10)
                                   for m in h.modules])  # fmt: skip

    base = sized(health(level=1501.0), params=51)
    inserted = sized(health(level=2001.0), params=272)
    gate = compare_to_baseline(inserted, base, "b.json", Tolerances(), "float16")
    assert "2 (Linear) activations peaked at 2001" in failed(gate)["headroom loss"]
    assert "not measured in the baseline" in failed(gate)["headroom loss"]
    same = sized(health(level=2001.0), params=51)  # the same head, grown 1.33x: a pass
    assert compare_to_baseline(same, base, "b.json", Tolerances(), "float16").passed
    old = health(level=1501.0)  # a baseline recorded before sizes: matched by path and type
    assert compare_to_baseline(inserted, old, "b.json", Tolerances(), "float16").passed


def test_growth_far_from_the_limit_is_not_a_regression():
    """The false alarm this gate was rebuilt for: 2x activations at 16 of 65504."""
    grown = health(scale=2.0, p90=2.5, loss=0.9, grad=3.0)
    assert compare_to_baseline(grown, health(), "b.json", Tolerances(), "float16").passed


def test_halved_float16_headroom_fails_naming_the_first_module():
    base, halved = health(level=3000.0), health(level=3000.0, scale=2.0)
    gate = compare_to_baseline(halved, base, "b.json", Tolerances(), "float16")
    assert failed(gate) == {
        "headroom loss": "2 (Linear) activations peaked at 6000, 9.2% of float16's 65504 and 2.0x "
        "the baseline's 3000 (limit 1.5x above 1.6% of the range) (and 1 more)"
    }


def test_the_same_growth_in_bfloat16_has_all_the_range_it_needs():
    base, halved = health(level=3000.0), health(level=3000.0, scale=2.0)
    assert compare_to_baseline(halved, base, "b.json", Tolerances(), "bfloat16").passed


def test_a_non_finite_peak_is_lost_headroom_in_any_dtype():
    gate = compare_to_baseline(health(scale=float("inf")), health(), "b", Tolerances(), "float32")
    assert "2 (Linear) activations peaked at inf" in failed(gate)["headroom loss"]


def test_a_new_streak_of_scaler_skips():
    gate = compare_to_baseline(health(streak=6), health(streak=3), "b.json", Tolerances())
    assert (
        failed(gate)["scaler skips"] == "longest streak of GradScaler skips 6 (baseline 3, limit 5)"
    )


def test_the_dynamics_checks_are_opt_in():
    gate = compare_to_baseline(health(scale=2.0, p90=2.5, loss=0.6), health(), "b.json", OPT_IN)
    assert failed(gate) == {
        "activation growth": "2 (Linear) activations peaked at 16, 2.0x the baseline's 8 "
        "(limit 1.5x) (and 1 more)",
        "gradient norm": "p90 gradient norm 2.5, 2.50x the baseline's 1 (limit 2x)",
        "final loss": "final loss 0.6 (baseline 0.5, limit 0.55)",
    }
    loose = replace(OPT_IN, max_activation_growth=3.0, max_gradient_growth=3.0)
    assert compare_to_baseline(health(scale=2.0, p90=2.5), health(), "b.json", loose).passed


def test_headroom_limit():
    check = headroom_check(replace(health(), headroom=0.93), 0.5)
    assert not check.passed and check.message == "peak at 93% of float16's 65504 in 2 (limit 50%)"
    gate = gate_of(replace(health(), headroom=0.93), "float16", Tolerances())
    assert gate is not None and failed(gate) == {"headroom": check.message}


def test_a_small_peak_and_a_tight_limit_keep_their_digits():
    """A bfloat16 run's peak is a fraction of a per cent of float16's range: in whole
    per cents, "peak at 0% (limit 0%)" failed with no visible reason."""
    check = headroom_check(replace(health(), headroom=0.00042), 0.0001)
    assert not check.passed
    assert check.message == "peak at 0.042% of float16's 65504 in 2 (limit 0.01%)"
    assert "peak at 5.1% " in headroom_check(replace(health(), headroom=0.0512), 0.5).message


def test_with_a_grad_scaler_the_scaled_gradients_are_the_scalers_business():
    base, grown = health(level=3000.0, grad=2000.0), health(level=3000.0, grad=5000.0)
    assert not compare_to_baseline(grown, base, "b", Tolerances(), "float16").passed
    assert compare_to_baseline(grown, base, "b", Tolerances(), "float16", grad_scaler=True).passed
