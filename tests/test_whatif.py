"""What-if verification replays the run with a fix: verified when it survives past the
failing step, refuted with the step where it still failed, unverified past the budget."""

from __future__ import annotations

import time

import pytest

from nandoctor.causes.index import FIXES
from nandoctor.causes.unit import Change, Fix
from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.diagnose.verify import CHANGES, applies, plan, verify
from nandoctor.registry import DuplicateError
from nandoctor.report.types import Cause
from nandoctor.runtime.patches import PATCHES, EpsilonPatch
from nandoctor.setup.load import load_config
from tests.conftest import CONFIGS
from tests.test_rules import case


def seed_report():
    return diagnose(load_config(CONFIGS / "seed-fp16-nan.yaml"))


def test_the_seed_example_shows_three_causes_with_replayed_verdicts():
    report = seed_report()
    by_id = {c.id: c for c in report.causes}
    assert report.causes[0].id == "log-of-softmax"
    assert {"log-of-softmax", "exploding-gradients", "learning-rate-too-high"} <= set(by_id)
    step = report.first_nonfinite.step
    assert by_id["log-of-softmax"].verified is True
    horizon = max(32, step // 4)  # a quarter of the way to the failure, at least 32 steps
    assert (
        f"to step {step + horizon}, past the failing step {step}"
        in by_id["log-of-softmax"].verification
    )
    assert by_id["learning-rate-too-high"].verified is True
    # clipping alone does not save this run: reported as failed, not dropped
    assert by_id["exploding-gradients"].verified is False
    assert "still went non-finite at step" in by_id["exploding-gradients"].verification


def test_a_spent_budget_leaves_causes_unverified():
    loaded = load_config(CONFIGS / "seed-fp16-nan.yaml")
    report = diagnose(loaded, DiagnoseOptions(verify_budget=0.0))
    assert all(c.verified is None for c in report.causes)
    assert all("time budget ran out" in (c.verification or "") for c in report.causes)


def test_a_cause_without_an_applicable_fix_is_returned_unchanged():
    cause = Cause("nondifferentiable-point", "t", 0.9)
    assert verify(cause, None, None, time.perf_counter() + 60) is cause


def test_every_config_change_has_one_way_to_apply_it():
    assert sorted(CHANGES) == sorted(change.name for change in Change)
    with pytest.raises(DuplicateError, match="config change 'BFLOAT16' is registered twice"):
        applies(Change.BFLOAT16)(lambda case, loaded: None)


def test_a_fix_plan_asks_for_a_patch_exactly_where_one_is_registered():
    patched = {cause_id for cause_id, fixes in FIXES.items() if any(f.patch for f in fixes)}
    assert patched == set(PATCHES)


def test_a_plan_applies_the_change_or_attaches_the_patch():
    loaded = load_config(CONFIGS / "eps-underflow.yaml")
    forward = plan("eps-underflow", Fix(patch=True), case("aten.div.Tensor"), loaded)
    assert forward.patch is EpsilonPatch and forward.loaded is loaded
    assert forward.describe == f"with {EpsilonPatch.describe}"
    bf16 = plan("fp16-overflow", Fix(Change.BFLOAT16), case("aten.mm.default"), loaded)
    assert bf16.describe == "with bfloat16 autocast instead of float16" and bf16.patch is None
    assert bf16.loaded.config.precision.dtype == "bfloat16"
    both = plan("eps-underflow", Fix(Change.BFLOAT16, patch=True), case("aten.mm.default"), loaded)
    assert both.describe == f"with bfloat16 autocast instead of float16 and {EpsilonPatch.describe}"
