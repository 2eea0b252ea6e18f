"""The sentinel's rules: the first non-finite phase fails the step; a GradScaler skip is
an event when its gradients are finite at loss scale 1 (or it could not be rechecked),
the failure itself when they are not, and skips that repeat until the scale collapses
fail. And the one sentinel on a loop driven from outside (the hooks' announcements):
scaled gradients, several losses in a step, a GradScaler met only mid-run, batches and
model outputs of every shape (keywords, dataclasses, a `ModelOutput` carrying its loss)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.judge import MAX_SKIP_STREAK, Judge
from nandoctor.runtime.probe import Phase, StepContext
from nandoctor.runtime.sentinel import Sentinel, _reading
from nandoctor.runtime.verdict import OVERFLOW, UNCHECKED, Reading, Verdict


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
    assert verdict.skip_reason == UNCHECKED  # nothing could recheck it


def test_a_skip_finite_at_loss_scale_one_is_an_overflow_and_only_skips_are_rechecked():
    asked: list[int] = []
    judge = Judge(recheck=lambda step: asked.append(step) or False)
    assert not judge(reading(step=2, scale=65536.0)).failed  # a clean step: no recheck
    verdict = judge(reading(step=3, scale=65536.0, grads=True))
    assert verdict.skipped and verdict.skip_reason == OVERFLOW and asked == [3]


def test_a_skip_still_nonfinite_at_loss_scale_one_is_the_failure_the_scaler_hid():
    judge = Judge(recheck=lambda step: step == 5)
    assert judge(reading(step=4, scale=65536.0, grads=True)).skip_reason == OVERFLOW
    verdict = judge(reading(step=5, scale=32768.0, grads=True))
    assert verdict.failed and verdict.hidden and not verdict.collapsed
    assert (verdict.step, verdict.phase) == (5, Phase.BACKWARD)  # its own step, not the streak's
    assert verdict.replay_scale == 1.0  # replayed unscaled: no overflow hides the origin
    assert "non-finite at loss scale 1 too" in verdict.why


def test_a_skip_that_could_not_be_rechecked_is_unchecked():
    verdict = Judge(recheck=lambda step: None)(reading(step=3, scale=1024.0, grads=True))
    assert verdict.skipped and verdict.skip_reason == UNCHECKED


def test_a_nonfinite_loss_fails_even_with_a_scaler():
    verdict = Judge()(reading(step=3, scale=65536.0, loss_bad=True, grads=True))
    assert verdict.failed and verdict.phase is Phase.LOSS


@pytest.mark.parametrize("recheck", [None, lambda step: False])
def test_a_streak_of_skips_fails_at_its_first_step(recheck):
    """Overflows or unchecked, MAX_SKIP_STREAK skips in a row collapse the scale (from
    torch's default 65536 down to 64: a healthy run skips a handful at its start)."""
    assert MAX_SKIP_STREAK == 10
    judge = Judge(recheck=recheck)
    verdicts = [
        judge(reading(step=s, scale=2.0**16 / 2**i, grads=True))
        for i, s in enumerate(range(10, 10 + MAX_SKIP_STREAK))
    ]
    assert all(v.skipped for v in verdicts[:-1])
    last = verdicts[-1]
    assert last.failed and last.step == 10 and last.phase is Phase.BACKWARD
    assert last.collapsed and not last.hidden and last.replay_scale == 2.0**16 / 2**9
    assert f"skipped {MAX_SKIP_STREAK} steps in a row from step 10" in last.why


def test_skips_above_the_default_initial_scale_do_not_count_towards_a_collapse():
    """A larger init_scale (Megatron's 2**32) comes down to 65536 first: those skips are
    its own choice, not a collapse."""
    judge = Judge()
    scales = [2.0**32 / 2**i for i in range(16 + MAX_SKIP_STREAK)]  # 2**32 down to 2**7
    verdicts = [judge(reading(step=i, scale=x, grads=True)) for i, x in enumerate(scales)]
    assert all(v.skipped for v in verdicts[:-1]) and verdicts[-1].failed
    assert verdicts[-1].step == 0 and "skipped 26 steps in a row from step 0" in verdicts[-1].why


def test_a_clean_step_ends_the_streak():
    judge = Judge()
    for s in range(MAX_SKIP_STREAK - 1):
        judge(reading(step=s, scale=2.0**10, grads=True))
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
    loss_dtype: torch.dtype = torch.float32,
    batches: list[torch.Tensor] | None = None,
    losses_add_up: bool = True,
) -> list[Verdict]:
    """One step as `StepHooks` announces a user's step: a forward, loss and backward per
    micro-batch (the gradients as backward left them, still scaled), then the update.
    `losses_add_up=False`: the losses are whole micro-batches', as in `run_step`."""
    ctx = StepContext(run, step, None, losses_add_up=losses_add_up)
    sentinel.step_started(ctx)
    for i, loss in enumerate(losses):
        ctx.batch = (batches[i] if batches is not None else torch.ones(2, 4),)
        sentinel.phase_ended(ctx, Phase.INPUT)
        ctx.loss = torch.tensor(loss, dtype=loss_dtype)
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


def test_a_batch_is_judged_only_in_a_step_that_failed_every_micro_batch_of_it():
    """A non-finite batch alone fails no step; in a failed step it names the phase,
    whichever micro-batch held it."""
    run, nan_batch = hooked_run(), torch.tensor([[float("nan"), 1.0]])
    batches = [nan_batch, torch.ones(2, 4)]
    (healthy,) = announce(Sentinel(run), run, 0, [1.0, 2.0], grad=0.1, batches=batches)
    assert not healthy.failed and not healthy.reading.input  # NB: not even looked at
    (failed,) = announce(Sentinel(run), run, 1, [1.0, float("inf")], grad=0.1, batches=batches)
    assert (failed.failed, failed.step, failed.phase) == (True, 1, Phase.INPUT)
    clean = [torch.ones(2, 4), torch.ones(2, 4)]
    (failed,) = announce(Sentinel(run), run, 2, [1.0, float("inf")], grad=0.1, batches=clean)
    assert failed.phase is Phase.LOSS


@pytest.mark.parametrize(("add_up", "loss"), [(True, 2.5), (False, 1.25)])
def test_a_steps_loss_is_what_a_trainer_logs_for_its_micro_batches(add_up, loss):
    """A user's loop backpropagates `loss / accum` in each micro-batch: the step's loss is
    the sum of those parts (as Trainer and Lightning log it; their mean was 1/N of it).
    nandoctor's own step announces each micro-batch's whole loss: their mean."""
    run = hooked_run()
    (verdict,) = announce(Sentinel(run), run, 0, [1.0, 1.5], grad=0.1, losses_add_up=add_up)
    assert verdict.reading.loss == loss


def test_a_nonfinite_loss_is_not_overwritten_by_the_next_micro_batch():
    run = hooked_run()
    (verdict,) = announce(Sentinel(run), run, 5, [float("nan"), 2.0], grad=0.1)
    assert verdict.failed and (verdict.step, verdict.phase) == (5, Phase.LOSS)
    assert math.isnan(verdict.reading.loss)


def test_weights_broken_between_steps_fail_in_the_parameters_phase_not_the_loss():
    """A non-finite loss has the weights it was computed with checked as the loss is read
    (on the CPU), before the backward and the update touch them: weights broken after
    the first step (a checkpoint loaded, an edit between steps) name the PARAMETERS
    phase; weights the step's own update breaks after a NaN loss leave it the loss's."""
    run = hooked_run()
    sentinel = Sentinel(run)
    announce(sentinel, run, 0, [1.0], grad=0.1)  # the weights' one check at the start
    with torch.no_grad():
        run.params[0][0, 0] = float("nan")  # between steps
    (broken,) = announce(sentinel, run, 1, [float("nan")], grad=float("nan"))
    assert (broken.failed, broken.step, broken.phase) == (True, 1, Phase.PARAMETERS)

    run = hooked_run()
    sentinel = Sentinel(run)
    announce(sentinel, run, 0, [1.0], grad=0.1)
    ctx = StepContext(run, 1, (torch.ones(2, 4),))
    sentinel.step_started(ctx)
    sentinel.phase_ended(ctx, Phase.INPUT)
    ctx.loss = torch.tensor(float("nan"))
    sentinel.phase_ended(ctx, Phase.LOSS)
    with torch.no_grad():
        run.params[0].fill_(float("nan"))  # the update, after the loss
    sentinel.phase_ended(ctx, Phase.OPTIMIZER)
    sentinel.step_ended(ctx)
    (verdict,) = sentinel.collect()
    assert (verdict.step, verdict.phase) == (1, Phase.LOSS)


def test_weights_an_update_within_the_step_broke_are_not_the_weights_it_began_with():
    """A loop with two optimizers in a step (a GAN's: the discriminator steps, then the
    generator's loss meets its broken weights): a NaN loss after an update in the same
    step is the loss's, not the parameters phase."""
    run = hooked_run()
    sentinel = Sentinel(run)
    ctx = StepContext(run, 0, (torch.ones(2, 4),))
    sentinel.step_started(ctx)
    for loss in (1.0, float("nan")):
        sentinel.phase_ended(ctx, Phase.INPUT)
        ctx.loss = torch.tensor(loss)
        sentinel.phase_ended(ctx, Phase.LOSS)
        with torch.no_grad():
            run.params[0].fill_(float("nan"))  # the first optimizer's update
        sentinel.phase_ended(ctx, Phase.OPTIMIZER)
    sentinel.step_ended(ctx)
    (verdict,) = sentinel.collect()
    assert (verdict.step, verdict.phase) == (0, Phase.LOSS)


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


# -- batches and model outputs of every shape ----------------------------------------
@dataclasses.dataclass
class Features:
    pixels: torch.Tensor
    labels: torch.Tensor


def nan_labels() -> torch.Tensor:
    return torch.tensor([0.5, float("nan")])


def batch_shapes() -> list:
    ids = torch.ones(2, 3, dtype=torch.long)
    shapes = [
        {"input_ids": ids, "labels": nan_labels()},  # model(**batch)
        {"0": torch.ones(2, 4), "labels": nan_labels()},  # model(x, labels=...)
        Features(torch.ones(2, 4), nan_labels()),
        [(ids, {"labels": nan_labels()})],
    ]
    try:  # a tokenizer's output: a mapping, not a dict
        from transformers import BatchEncoding
    except ImportError:
        return shapes
    return [*shapes, BatchEncoding({"input_ids": ids, "labels": nan_labels()})]


def one_step(sentinel: Sentinel, run: HookedRun, batch, output, loss: float) -> Verdict:
    """A step announced up to its loss: the batch, the model's output, the loss."""
    ctx = StepContext(run, 0, batch)
    sentinel.step_started(ctx)
    sentinel.phase_ended(ctx, Phase.INPUT)
    ctx.output = output
    sentinel.phase_ended(ctx, Phase.FORWARD)
    ctx.loss = torch.tensor(loss)
    sentinel.phase_ended(ctx, Phase.LOSS)
    sentinel.step_ended(ctx)
    (verdict,) = sentinel.collect()
    return verdict


def test_a_nan_anywhere_in_a_keyword_or_structured_batch_is_the_input_phase():
    for batch in batch_shapes():
        run = hooked_run()
        verdict = one_step(Sentinel(run), run, batch, torch.ones(2), float("nan"))
        assert verdict.failed and verdict.phase is Phase.INPUT, type(batch)


def additive_mask(nan: bool = False) -> torch.Tensor:
    """A 4-D additive attention mask (0 kept, -inf masked), as a collate function builds
    it; with `nan`, one NaN among its values (bad data after all)."""
    mask = torch.zeros(2, 1, 4, 4)
    mask[..., 2:] = float("-inf")
    mask[1] = float("-inf")  # NB: the second example is all padding: its rows are all -inf
    if nan:
        mask[0, 0, 0, 0] = float("nan")
    return mask


def test_an_additive_mask_in_the_batch_is_no_bad_input():
    """Its -inf are deliberate: a row it masks entirely fails in the model's softmax (the
    replay names fully-masked-softmax), so the failure is not the batch's, even where no
    replay follows (`watch --no-replay`, `compare`). A NaN among its values is bad data."""
    for nan, phase in ((False, Phase.FORWARD), (True, Phase.INPUT)):
        run = hooked_run()
        sentinel = Sentinel(run, thorough=True)
        batch = {"x": torch.ones(2, 4), "attention_mask": additive_mask(nan)}
        ctx = StepContext(run, 2, batch)
        sentinel.step_started(ctx)
        sentinel.phase_ended(ctx, Phase.INPUT)
        ctx.output = torch.full((2, 3), float("nan"))
        sentinel.phase_ended(ctx, Phase.FORWARD)
        ctx.loss = torch.tensor(float("nan"))
        sentinel.phase_ended(ctx, Phase.LOSS)
        sentinel.step_ended(ctx)
        (verdict,) = sentinel.collect(final=True)
        assert verdict.failed and verdict.phase is phase, nan


def model_outputs(loss: float, logits: float) -> list:
    """A dict and, where transformers is installed, a `ModelOutput`, each carrying a loss."""
    values = {"loss": torch.tensor(loss), "logits": torch.full((2, 3), logits)}
    outputs = [dict(values)]
    try:
        from transformers.modeling_outputs import SequenceClassifierOutput
    except ImportError:
        return outputs
    return [*outputs, SequenceClassifierOutput(**values)]


@pytest.mark.parametrize(
    ("loss", "logits", "phase"),
    [(float("nan"), 1.0, Phase.LOSS), (float("nan"), float("nan"), Phase.FORWARD)],
)
def test_the_loss_a_model_output_carries_is_judged_apart_from_its_logits(loss, logits, phase):
    """`compare`'s thorough sentinel checks the model's output: a NaN loss computed by
    the model beside finite logits is the loss phase; NaN logits are the forward's."""
    for output in model_outputs(loss, logits):
        run = hooked_run()
        verdict = one_step(Sentinel(run, thorough=True), run, (torch.ones(2, 4),), output, loss)
        assert verdict.failed and verdict.phase is phase, type(output)


# -- the CPU's reading: flags judged on the host ------------------------------------------
def test_huge_finite_gradients_are_not_a_failure_although_their_float32_norm_overflows():
    """On the CPU the gradients' flag is their float32 norm's finiteness; 1e20 squared
    overflows float32, so an infinite norm is rechecked element by element, and the norm
    the telemetry records is measured again in float64 (a diverging run's trend and the
    gate's gradient growth read it: an inf there would be a failure that never was)."""
    run = hooked_run()
    (verdict,) = announce(Sentinel(run), run, 0, [1.0], grad=1e20)
    assert not verdict.failed and not verdict.reading.grads
    numel = sum(p.numel() for p in run.params)
    assert verdict.reading.grad_norm == pytest.approx(1e20 * math.sqrt(numel), rel=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_an_infinite_or_nan_gradient_fails_in_backward(bad):
    run = hooked_run()
    (verdict,) = announce(Sentinel(run), run, 4, [1.0], grad=bad)
    assert verdict.failed and (verdict.step, verdict.phase) == (4, Phase.BACKWARD)


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("defer", [False, pytest.param(True, marks=[pytest.mark.cuda, NEEDS_CUDA])])
def test_the_cpu_reading_and_the_device_reading_agree(defer):
    """The deferred reading (CUDA's way: flags judged on the device) and the CPU's (flags
    judged on the host) give the same verdicts, step by step."""
    run = hooked_run()
    sentinel = Sentinel(run, defer=defer)
    grads = [0.5, 1e20, float("inf")]
    verdicts = [announce(sentinel, run, i, [1.0], grad=g) for i, g in enumerate(grads)]
    verdicts = [v for vs in verdicts for v in vs] + list(sentinel.collect(final=True))
    assert [v.failed for v in verdicts] == [False, False, True]


def test_a_float64_loss_beyond_float32_range_is_finite():
    run = hooked_run()
    (verdict,) = announce(Sentinel(run), run, 0, [1e300], grad=0.1, loss_dtype=torch.float64)
    assert not verdict.failed and verdict.reading.loss == 1e300


def test_a_step_that_announced_nothing_but_its_update_reads_as_clean():
    """A hooked step may open with the optimizer's step alone (nothing to read on the
    CPU): a clean reading, not an error."""
    run = hooked_run()
    sentinel = Sentinel(run)
    announce(sentinel, run, 0, [1.0], grad=0.1)  # the weights are checked once, here
    ctx = StepContext(run, 1, None)
    sentinel.step_started(ctx)
    sentinel.phase_ended(ctx, Phase.OPTIMIZER)
    sentinel.step_ended(ctx)
    (verdict,) = sentinel.collect()
    assert not verdict.failed and verdict.reading.step == 1


# -- values that heal: a non-finite batch or output fails a step only with what it reaches --
@pytest.mark.parametrize(
    "flags", [{"input": True}, {"forward": True}, {"input": True, "forward": True}]
)
def test_a_batch_or_output_whose_nan_the_loss_selects_away_leaves_the_step_healthy(flags):
    """Labels missing as NaN and masked in the loss: the loss, the gradients and the
    weights stay finite, so nothing failed (SPEC: values that heal are never the origin)."""
    assert not Judge()(reading(step=4, **flags)).failed


@pytest.mark.parametrize(
    ("flags", "phase"),
    [
        ({"input": True, "grads": True}, Phase.INPUT),
        ({"forward": True, "grads": True}, Phase.FORWARD),
        ({"input": True, "params": True}, Phase.INPUT),
    ],
)
def test_a_failure_the_batch_or_output_reaches_begins_in_their_phase(flags, phase):
    verdict = Judge()(reading(step=4, **flags))
    assert verdict.failed and (verdict.step, verdict.phase) == (4, phase)


def test_a_scaler_skip_beside_a_masked_batch_is_still_only_a_skip():
    verdict = Judge(recheck=lambda step: False)(
        reading(step=4, scale=2.0**16, input=True, grads=True)
    )
    assert verdict.skipped and not verdict.failed and verdict.skip_reason == OVERFLOW


def test_a_failure_the_scaler_hid_beside_a_bad_batch_begins_in_the_batch():
    verdict = Judge(recheck=lambda step: True)(
        reading(step=4, scale=2.0**16, input=True, grads=True)
    )
    assert verdict.failed and verdict.hidden and verdict.phase is Phase.INPUT
    assert verdict.replay_scale == 1.0  # still replayed unscaled


def test_a_collapse_still_points_back_to_its_streak_when_its_last_batch_is_bad():
    judge = Judge(max_streak=3)
    for s in (1, 2):
        assert judge(reading(step=s, scale=2.0**10, grads=True)).skipped
    verdict = judge(reading(step=3, scale=2.0**10, input=True, grads=True))
    assert (
        verdict.failed
        and verdict.collapsed
        and (verdict.step, verdict.phase) == (1, Phase.BACKWARD)
    )


def test_a_rank_whose_masked_nan_healed_is_not_named_an_origin():
    """Rank 0's batch holds labels missing as NaN (masked: its loss and own gradients stay
    finite); rank 1's own gradients went NaN: rank 1 is the origin, rank 0 inherited it."""
    # the slots: params_before, input, forward, local_grads, grads, params, loss, norm, scale
    masked = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.5, float("nan"), 0.0]
    broken = [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.7, float("nan"), 0.0]
    r = _reading(3, [masked, broken], has_scale=False)
    assert (r.origin_ranks, r.inherited_ranks) == ((1,), (0,))
    verdict = Judge()(r)
    assert verdict.failed and verdict.phase is Phase.BACKWARD  # rank 1's, not rank 0's batch
