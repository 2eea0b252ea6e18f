"""What-if verification replays the run with a fix: verified when it survives past the
failing step and keeps learning, refuted with the step where it still failed, "stopped
learning" when it stayed finite without learning, unverified past the budget; then the
causes are ranked again by what their replays showed."""

from __future__ import annotations

import re
import time
from dataclasses import replace

import pytest

from nandoctor.causes.index import FIXES
from nandoctor.causes.ranking import Replay, rerank
from nandoctor.causes.unit import GUARD_ORIGIN, Change, Fix
from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.diagnose.plans import CHANGES, REACH, Plan, Reach, applies, origin_site, plan
from nandoctor.diagnose.verify import (
    FixOutcome,
    Resume,
    _behind_others,
    _loss_words,
    combined,
    run_plan,
    verify,
)
from nandoctor.registry import DuplicateError
from nandoctor.report.evidence import Evidence
from nandoctor.report.types import Cause, Frame
from nandoctor.runtime.fast_run import fast_run
from nandoctor.runtime.patches import PATCHES, EpsilonPatch, OriginGuardPatch
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.setup.load import LoadedConfig, load_config
from nandoctor.setup.session import build_session
from tests.causes.test_rules import case
from tests.examples.test_shipped_configs import report_of
from tests.helpers.paths import CONFIGS


def seed_report():
    return report_of("seed-fp16-nan.yaml")


def seed_with_snapshots_every(every: int):
    loaded = load_config(CONFIGS / "seed-fp16-nan.yaml")
    policy = loaded.config.snapshot.model_copy(update={"every": every})
    return diagnose(
        LoadedConfig(loaded.config.model_copy(update={"snapshot": policy}), loaded.path)
    )


def test_the_seed_example_shows_three_causes_with_replayed_verdicts():
    """As shipped, the seed fails at step 26, before the auto policy's second snapshot
    (step 32): every fix is replayed from the start, 32 steps past the failure."""
    report = seed_report()
    by_id = {c.id: c for c in report.causes}
    assert report.causes[0].id == "log-of-softmax"
    assert {"log-of-softmax", "exploding-gradients", "learning-rate-too-high"} <= set(by_id)
    step = report.first_nonfinite.step
    for held in ("log-of-softmax", "learning-rate-too-high"):
        assert by_id[held].verified is True
        assert (
            f"applied from step 0, {step + 33}/{step + 33} steps stayed finite, to step "
            f"{step + 32}, past the failing step {step}" in by_id[held].verification
        )
    # clipping alone does not save this run: reported as failed, not dropped, and ranked
    # below both causes whose fixes held (from the start, one replay says it all)
    clipped = by_id["exploding-gradients"]
    assert clipped.verified is False
    assert re.fullmatch(
        r"with unscale_ then clip_grad_norm_\(1.0\), applied from step 0, the run still went "
        r"non-finite at step \d+ \(phase [\w ]+\)",
        clipped.verification,
    ), clipped.verification
    assert [c.id for c in report.causes][-1] == "exploding-gradients"


def test_a_fix_resumes_from_the_newest_snapshot_before_the_failure():
    """Every 16 steps, the newest snapshot before the seed's failure at step 26 is step 16:
    each fix is applied from there, as a user resumes from a checkpoint, 32 steps past the
    failure; clipping, refuted there, is replayed from the start too and still fails."""
    report = seed_with_snapshots_every(16)
    by_id = {c.id: c for c in report.causes}
    step = report.first_nonfinite.step
    for held in ("log-of-softmax", "learning-rate-too-high"):
        assert by_id[held].verified is True
        assert (
            f"applied from step 16 (resumed from a snapshot), {step + 32 - 16 + 1}/"
            f"{step + 32 - 16 + 1} steps stayed finite, to step {step + 32}, past the failing "
            f"step {step}" in by_id[held].verification
        ), by_id[held].verification
    clipped = by_id["exploding-gradients"]
    assert clipped.verified is False
    assert re.fullmatch(
        r"with unscale_ then clip_grad_norm_\(1.0\), applied from step 16 \(resumed from a "
        r"snapshot\), the run still went non-finite at step \d+ \(phase [\w ]+\); applied from "
        r"step 0, the run still went non-finite at step \d+ \(phase [\w ]+\)",
        clipped.verification,
    ), clipped.verification


def test_a_fix_refuted_from_its_snapshot_is_replayed_from_the_start():
    """With a snapshot every 8 steps, the newest before the seed's failure at step 26 is
    step 24: a smaller learning rate from there is too late. Refuted from the snapshot,
    the fix is replayed from step 0 (a quarter further), where it holds."""
    report = seed_with_snapshots_every(8)
    (cause,) = [c for c in report.causes if c.id == "learning-rate-too-high"]
    step = report.first_nonfinite.step
    horizon = max(32, step // 4)
    assert cause.verified is True
    assert re.search(
        rf"applied from step 24 \(resumed from a snapshot\), the run still went non-finite at "
        rf"step \d+ \(phase [\w ]+\); applied from step 0, {step + horizon + 1}/"
        rf"{step + horizon + 1} steps stayed finite, to step {step + horizon}",
        cause.verification,
    ), cause.verification


def test_a_replay_resumed_from_a_snapshot_sees_the_run_as_it_was():
    """Resumed with nothing changed, the replay fails at the very step the run failed:
    the snapshot's weights, optimizer, scaler and RNG and the stream's batches line up."""
    loaded = load_config(CONFIGS / "seed-fp16-nan.yaml")
    session = build_session(loaded)
    store = SnapshotStore(session, every=4)
    failing = fast_run(session, loaded.config.steps, store=store).failure.step
    snapshot = store.resume_point(failing - 1)
    assert 0 < snapshot.step < failing
    c = case("aten.log.default", "loss")
    c = replace(c, first=replace(c.first, step=failing))
    unchanged = Plan("with nothing changed", loaded)
    verdict = run_plan(unchanged, c, time.perf_counter() + 120, Resume(snapshot, loaded))
    assert verdict.replay is Replay.REFUTED
    assert verdict.sentence == (
        f"with nothing changed, applied from step {snapshot.step} (resumed from a snapshot), "
        f"the run still went non-finite at step {failing} (phase forward or loss)"
    )  # NB: the replay does not look at the model's output: a NaN made there shows in the loss


def test_only_fixes_that_need_the_whole_history_replay_from_the_start():
    assert {c for c, r in REACH.items() if r is Reach.LOADED} == {Change.ZERO_NONFINITE_WEIGHTS}
    loaded = load_config(CONFIGS / "nonfinite-parameters.yaml")
    zeroed = plan("nonfinite-parameters", Fix(Change.ZERO_NONFINITE_WEIGHTS), case(None), loaded)
    bf16 = plan("fp16-overflow", Fix(Change.BFLOAT16), case("aten.mm.default"), loaded)
    assert zeroed.from_start and not bf16.from_start


def test_a_smaller_rate_resumed_from_a_snapshot_scales_the_rate_in_effect():
    """A user resuming with lr / 10 gets a tenth of the rate the schedule had reached,
    and the scheduler keeps scheduling from a tenth of its base rate."""
    loaded = load_config(CONFIGS / "seed-fp16-nan.yaml")
    session = build_session(loaded)
    store = SnapshotStore(session, every=1)
    fast_run(session, 3, store=store)
    smaller = CHANGES[Change.SMALLER_LR.name](case("aten.mm.default"), loaded)
    fixed = build_session(smaller.loaded)
    Resume(store.resume_point(2), loaded).apply(fixed, smaller.loaded)
    lr = loaded.config.optimizer.kwargs["lr"]
    assert fixed.optimizer.param_groups[0]["lr"] == pytest.approx(lr / 10)
    assert fixed.start_step == 2


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


# -- ranking by the replays -----------------------------------------------------------------
def cause(cause_id: str, confidence: float) -> Cause:
    return Cause(cause_id, "t", confidence)


def test_a_fix_that_held_outranks_one_that_was_refuted_whatever_the_confidence():
    ranked = rerank(
        [
            (cause("exploding-gradients", 0.85), Replay.REFUTED),
            (cause("division-by-zero", 0.8), Replay.STOPPED_LEARNING),
            (cause("nonfinite-input", 0.5), Replay.NOT_REPLAYED),
            (cause("learning-rate-too-high", 0.35), Replay.HELD),
        ]
    )
    assert [(c.id, c.confidence) for c in ranked] == [
        ("nonfinite-input", 0.5),
        ("learning-rate-too-high", 0.35),
        ("division-by-zero", 0.64),  # x 0.8: finite, but it stopped learning
        ("exploding-gradients", 0.42),  # x 0.5, rounded half to even: refuted
    ]


def test_a_held_fix_whose_run_ended_far_above_another_held_fixs_trails_it():
    """A VAE whose warmup peaks at a 10x too high rate: bfloat16 kept it finite (its loss
    ended at 186) and ranked first on its confidence, above the smaller rate that made it
    train (11.2): both held, and the ranking said nothing of the difference."""
    held = FixOutcome(
        Replay.HELD, "with bfloat16, ...; the loss fell from 1.13e+04 to 186", end=186
    )
    ahead = FixOutcome(Replay.HELD, "with a 10x smaller rate, ...; 16.3 to 11.2", end=11.2)
    fp16 = replace(cause("fp16-overflow", 0.75), verification=held.sentence, verified=True)
    lr = replace(cause("learning-rate-too-high", 0.5), verification=ahead.sentence)
    weighed = _behind_others([(fp16, held), (lr, ahead)])
    assert [r for _, r in weighed] == [Replay.BEHIND, Replay.HELD]
    trails = "its loss ended 16.6x above where the learning-rate-too-high fix left it"
    assert weighed[0][0].verification.endswith(f"; {trails} (186 against 11.2)")
    ranked = rerank(weighed)
    assert [(c.id, c.confidence, c.verified) for c in ranked] == [
        ("learning-rate-too-high", 0.5, None),
        ("fp16-overflow", 0.75, True),  # still verified: it did keep the run finite
    ]
    near = FixOutcome(Replay.HELD, "...", end=90.0)  # under 10x the best: no judgement made
    assert [r for _, r in _behind_others([(fp16, near), (lr, ahead)])] == [Replay.HELD] * 2


def test_held_fixes_whose_losses_end_at_or_below_zero_are_not_weighed_by_a_ratio():
    """A Gaussian's negative log-likelihood: -0.1 is not "0.25x above" -0.4, and no ratio
    of the two says which fix trains better."""
    deeper = FixOutcome(Replay.HELD, "with a, ...; the loss fell from 1 to -0.4", end=-0.4)
    shallower = FixOutcome(Replay.HELD, "with b, ...; the loss fell from 1 to -0.1", end=-0.1)
    pairs = [(cause("fp16-overflow", 0.75), shallower), (cause("exploding-gradients", 0.5), deeper)]
    weighed = _behind_others(pairs)
    assert [r for _, r in weighed] == [Replay.HELD, Replay.HELD]
    assert [c.verification for c, _ in weighed] == [None, None]


def test_reranking_is_deterministic_and_keeps_the_rules_order_on_ties():
    pairs = [(cause(f"c{i}", 0.5), Replay.HELD) for i in range(5)]
    assert [c.id for c in rerank(pairs)] == ["c0", "c1", "c2", "c3", "c4"]
    assert rerank(pairs) == rerank(list(pairs))


def test_fixes_are_tried_in_order_until_one_holds():
    refuted = FixOutcome(Replay.REFUTED, "with a, the run still went non-finite at step 3")
    held = FixOutcome(Replay.HELD, "with b, 40/40 steps stayed finite")
    nothing = FixOutcome(Replay.NOT_REPLAYED, "with c: the patch found nothing", applied=False)
    both = combined([nothing, refuted, held])
    assert both.replay is Replay.HELD and both.verified is True
    assert both.sentence == f"{refuted.sentence}; {held.sentence}"
    assert combined([nothing]).verified is None
    assert combined([refuted, nothing]).sentence == refuted.sentence


# -- guarding the origin op -------------------------------------------------------------------
def test_the_origin_site_is_the_op_and_the_users_line():
    forward = origin_site(case("aten.div.Tensor"))
    assert (forward.family, forward.line, forward.overflowed) == ("div", 3, False)
    assert forward.file.endswith("m.py")
    backward = case("aten.mul.Tensor", "backward", "inf", backward_of="torch.sqrt (SqrtBackward0)")
    assert origin_site(backward).family == "sqrt" and origin_site(backward).overflowed
    unnamed = case(None, "input")
    assert origin_site(unnamed) is None


def test_an_op_in_a_library_is_keyed_on_the_librarys_line_past_torchs_own():
    frames = [
        Frame("torch/nn/functional.py", 3555, False),
        Frame("transformers/models/bert/modeling_bert.py", 973, False),
        Frame("train.py", 41, True),
    ]
    c = case("aten.div.Tensor")
    c = replace(c, first=replace(c.first, frames=frames, source="train.py:41"))
    site = origin_site(c)
    assert (site.file, site.line, site.library) == (frames[1].file, 973, True)
    c = replace(c, first=replace(c.first, frames=[frames[0], frames[2]]))
    assert (origin_site(c).line, origin_site(c).library) == (41, False)  # torch's: the user's


def test_a_guard_plan_names_the_op_and_the_line():
    loaded = load_config(CONFIGS / "division-by-zero.yaml")
    guarded = plan("division-by-zero", GUARD_ORIGIN, case("aten.div.Tensor"), loaded)
    assert guarded.describe == "with the div at m.py:3 guarded (denominator moved away from 0)"
    assert isinstance(guarded.patch(), OriginGuardPatch) and guarded.loaded is loaded
    assert plan("division-by-zero", GUARD_ORIGIN, case(None, "input"), loaded) is None


def test_every_cause_of_the_op_itself_has_a_replay():
    """The math causes whose fix is in the user's code are verified by the guard."""
    guarded = {cause_id for cause_id, fixes in FIXES.items() if GUARD_ORIGIN in fixes}
    assert {
        "division-by-zero",
        "log-of-zero",
        "invalid-domain",
        "nondifferentiable-point",
        "eps-underflow",
        "grad-scaler-collapse",
    } <= guarded


def test_zeroed_weights_that_cannot_learn_are_not_a_verified_fix():
    """The shipped checkpoint lost every weight: zeroed, the run stays finite, and flat."""
    report = report_of("nonfinite-parameters.yaml")
    (top,) = report.causes
    assert top.id == "nonfinite-parameters" and top.verified is False
    assert top.verification.startswith(
        "with the non-finite entries of the loaded weights and optimizer state zeroed, "
    )
    assert "but the run stopped learning: its loss fell by only" in top.verification
    assert top.confidence == round(0.99 * 0.8, 2)


def test_zeroing_is_for_loaded_weights_only():
    loaded = load_config(CONFIGS / "nonfinite-input.yaml")
    assert CHANGES[Change.ZERO_NONFINITE_WEIGHTS.name](case(None, "parameters"), loaded) is None
    loaded = load_config(CONFIGS / "nonfinite-parameters.yaml")
    zeroing = CHANGES[Change.ZERO_NONFINITE_WEIGHTS.name](case(None, "parameters"), loaded)
    assert zeroing.prepare is not None and zeroing.loaded is loaded


def test_a_case_needs_evidence_for_a_backward_site():
    plain = replace(case("aten.div.Tensor", "backward"), evidence=Evidence())
    assert origin_site(plain).family == "div"  # no backward_of: the op's own family


@pytest.mark.parametrize(
    ("start", "end", "reference", "words"),
    [
        (2.19, 1.1, None, "; the loss fell from 2.19 to 1.1"),
        (2.3026, 2.3019, 2.31, "; the loss held at 2.3 (the original run's was 2.31)"),
        (2.30, 2.31, 2.31, "; the loss held at 2.31 (the original run's was 2.31)"),
        (None, None, None, ""),
    ],
)
def test_a_held_fix_says_how_its_loss_went_in_words_its_numbers_allow(start, end, reference, words):
    """Never "fell from 2.3 to 2.3": a resumed check may hold level, judged against the
    original run's loss."""
    assert _loss_words(start, end, reference) == words
