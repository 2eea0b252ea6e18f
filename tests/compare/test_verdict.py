"""The compare verdict tells the user what to do, honestly."""

from __future__ import annotations

from dataclasses import replace

from nandoctor.compare.verdict import compare_verdict
from nandoctor.report.comparison import CompareRun, Headroom


def run(dtype, status="healthy", step=None, headroom=0.1, drift=None, phase="forward"):
    peak = [Headroom("blocks.3.mlp.fc2", "Linear", headroom * 65504, 411)]
    return CompareRun(
        dtype,
        dtype == "float16",
        status,
        step or 400,
        step,
        phase if step else None,
        1.0,
        drift,
        2.0,
        peak,
    )


def test_switch_to_bf16_when_it_survives():
    fp16 = run("float16", "nonfinite", 411, headroom=1.0)
    runs = [fp16, run("bfloat16", drift=0.012), run("float32", drift=0.0)]
    verdict = compare_verdict(runs, "float16", 500)
    assert verdict == (
        "bfloat16 survived all 500 steps where float16 went non-finite at step 411 "
        "(phase forward); "
        "float16's activation was at 100% of float16's range in blocks.3.mlp.fc2 at step 411: "
        "switch autocast to bfloat16 (8 exponent bits: the range of float32); "
        "its loss stayed within 0.012 of float32's"
    )


def test_the_range_of_float16_explains_only_a_float16_failure():
    """A bfloat16 run's headroom is measured against 65504 as a forecast: it never
    explains why bfloat16 failed where float32 held."""
    runs = [run("bfloat16", "nonfinite", 3, headroom=0.62), run("float32", drift=0.0)]
    verdict = compare_verdict(runs, "bfloat16", 8)
    assert verdict.startswith("float32 survived all 8 steps where bfloat16 went non-finite")
    assert "range" not in verdict.split(":")[0] and "65504" not in verdict


def test_a_failure_in_the_loss_points_at_the_loss_too():
    """A hand-written log(softmax) that bfloat16 outlived is still a broken loss."""
    runs = [run("float16", "nonfinite", 51, phase="loss"), run("bfloat16")]
    verdict = compare_verdict(runs, "float16", 2000)
    assert "switch autocast to bfloat16" in verdict
    assert "or fix the loss" in verdict and "`nandoctor diagnose` names it" in verdict
    runs = [run("float16", "nonfinite", 51), run("bfloat16")]
    assert "fix the loss" not in compare_verdict(runs, "float16", 2000)
    # a bfloat16 config's float16 run outlived it: float16 is no wider (it said so)
    runs = [run("bfloat16", "nonfinite", 16, phase="loss"), run("float16")]
    verdict = compare_verdict(runs, "bfloat16", 400)
    assert "wider" not in verdict and "which another dtype only makes rarer" in verdict


def test_every_dtype_failing_means_the_dtype_is_not_the_cause():
    verdict = compare_verdict(
        [run("float16", "nonfinite", 26), run("bfloat16", "nonfinite", 212)], "float16", 400
    )
    assert "every dtype went non-finite (float16 at step 26, bfloat16 at step 212)" in verdict
    assert "bfloat16 only delays it" in verdict and "the dtype is not the cause" in verdict


def test_a_dtype_failing_far_sooner_than_the_others_is_a_failure_of_its_own():
    """float16 died of its range at step 0, bfloat16 and float32 of a learning-rate ramp
    at 116 and 117: "bfloat16 only delays it: the dtype is not the cause" was half wrong
    (fixing the rate alone leaves float16 dead at step 0)."""
    runs = [run("float16", "nonfinite", 0), run("bfloat16", "nonfinite", 116),
            run("float32", "nonfinite", 117)]  # fmt: skip
    verdict = compare_verdict(runs, "float16", 300)
    assert verdict.startswith("every dtype went non-finite (float16 at step 0, bfloat16 at")
    assert "float16 10x sooner: two failures" in verdict and "the dtype is not" not in verdict
    assert "`--dtype bf16` for the later one" in verdict


def test_the_grad_scalers_scaled_gradients_are_no_lost_headroom():
    """A gradient at 67% of 65504 at step 0 is 0.668 times the initial scale of 65536: the
    scaler calibrating itself, with activations at 12%; it warned of little headroom."""
    scaled = Headroom("head", "Linear", 0.12 * 65504, 0, 0.67 * 65504, 0)
    fp16 = replace(run("float16"), headroom=[scaled])  # run() has a GradScaler for float16
    verdict = compare_verdict([fp16, run("bfloat16")], "float16", 100)
    assert "headroom" not in verdict and "67%" not in verdict
    unscaled = replace(fp16, grad_scaler=False)  # a float16 run without one: its own
    assert "gradient was at 67%" in compare_verdict([unscaled, run("bfloat16")], "float16", 100)


def test_all_healthy_with_little_headroom_warns():
    verdict = compare_verdict([run("float16", headroom=0.8), run("bfloat16")], "float16", 100)
    assert verdict.startswith(
        "every dtype stayed finite for all 100 steps, but float16's activation was at 80%"
    )


def test_only_float32_surviving():
    runs = [run("float16", "nonfinite", 5), run("bfloat16", "nonfinite", 9), run("float32")]
    assert "only float32 survived" in compare_verdict(runs, "float16", 50)


def test_config_dtype_healthy_another_failing():
    verdict = compare_verdict([run("float32"), run("float16", "nonfinite", 7)], "float32", 50)
    assert verdict.startswith("float32, the config's dtype, stayed finite") and verdict.endswith(
        "keep float32"
    )


def test_a_survivor_that_does_not_train_is_not_the_dtype_to_switch_to():
    """bfloat16 stayed finite where float16 failed, at a loss of 46720 beside float32's
    0.139: "switch autocast to bfloat16; its loss stayed within 9.1e+04 of float32's"."""
    fp16 = run("float16", "nonfinite", 40, headroom=1.0)
    bf16 = replace(run("bfloat16", drift=9.1e4), final_loss=46720.0)
    fp32 = replace(run("float32", drift=0.0), final_loss=0.139)
    verdict = compare_verdict([fp16, bf16, fp32], "float16", 400)
    assert verdict.startswith("float32 survived all 400 steps where float16 went non-finite")
    assert "bfloat16's loss ended 3.36e+05x above float32's (4.67e+04 against 0.139)" in verdict
    assert verdict.endswith("keep the failing part of the model in float32")
    assert "switch autocast to bfloat16" not in verdict and "stayed within" not in verdict


def test_all_finite_but_one_dtype_far_behind_is_said_and_not_advised():
    fp16 = replace(run("float16", headroom=0.8), final_loss=1.97)
    bf16 = replace(run("bfloat16"), final_loss=86.8)
    verdict = compare_verdict([fp16, bf16], "float16", 100)
    assert "consider bfloat16" not in verdict
    assert verdict.endswith(
        "but bfloat16's loss ended 44.1x above float16's (86.8 against 1.97): it stays finite "
        "but does not train as well here"
    )
    near = replace(bf16, final_loss=3.0)  # within 10x: not weighed
    assert "consider bfloat16" in compare_verdict([fp16, near], "float16", 100)
