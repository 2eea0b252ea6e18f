"""The one training step, with gradient accumulation: `grad_accum_steps: N` runs N
micro-batches per optimizer step (each loss / N), unscales and clips once, and numbers
steps by optimizer step (batch i is step i // N, micro-batch i % N)."""

from __future__ import annotations

import types

import pytest
import torch

from nandoctor.compare.engine import compare
from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.runtime.probe import Phase, Probe, Probes
from nandoctor.runtime.sentinel import Sentinel
from nandoctor.runtime.step import run_step
from nandoctor.setup.data import MicroBatches
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.helpers.project import base_config

NO_VERIFY = DiagnoseOptions(verify=False)


def test_a_nan_in_batch_37_with_4_micro_batches_is_step_9_micro_batch_1(project):
    config = base_config(data_args={"batches": 40, "nan_at": 37}, grad_accum_steps=4, steps=12)
    report = diagnose(load_config(project(config)), NO_VERIFY)
    first = report.first_nonfinite
    assert (first.step, first.micro_batch, first.phase) == (9, 1, "input")
    assert report.steps_completed == 9
    assert report.to_dict()["first_nonfinite"]["micro_batch"] == 1
    assert report.summary.startswith("step 9, micro-batch 1, phase input")


def test_without_accumulation_the_report_names_no_micro_batch(project):
    config = base_config(data_args={"batches": 8, "nan_at": 5}, steps=8)
    first = diagnose(load_config(project(config)), NO_VERIFY).first_nonfinite
    assert (first.step, first.micro_batch) == (5, None)


def test_a_nan_born_in_the_forward_names_its_micro_batch(project):
    code_loss = """
    import torch.nn.functional as F
    def loss_nan_at_second(model, batch):
        x, y = batch
        out = model(x)
        if float(x[0, 0]) == 123.0:   # the marked micro-batch: log of a negative number
            out = out.clamp(max=-1.0).log()
        return F.cross_entropy(out, y)
    """
    path = project(
        base_config(
            data="train.py:build_data",
            loss="losses.py:loss_nan_at_second",
            data_args={"batches": 12},
            grad_accum_steps=3,
            steps=4,
        )
    )
    (path.parent / "losses.py").write_text(_dedent(code_loss))
    _mark_batch(path.parent / "train.py", index=7)  # step 2, micro-batch 1
    report = diagnose(load_config(path), NO_VERIFY)
    first = report.first_nonfinite
    assert (first.step, first.micro_batch, first.phase) == (2, 1, "loss")
    assert first.op == "aten.log.default"


def test_accumulated_micro_batches_step_like_their_concatenation(project):
    """N micro-batches of b, each loss / N, make the update one batch of N*b makes."""
    path = project(base_config(data_args={"batches": 4, "batch_size": 8}, grad_accum_steps=4))
    accumulated = build_session(load_config(path))
    whole = build_session(load_config(path).with_overrides(grad_accum_steps=1))
    _, batch = next(iter(accumulated.batches))
    assert isinstance(batch, MicroBatches) and len(batch.batches) == 4
    joined = tuple(torch.cat(parts) for parts in zip(*batch.batches, strict=True))
    run_step(accumulated, 0, batch, Probe())
    run_step(whole, 0, joined, Probe())
    for a, b in zip(accumulated.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_unscale_and_clipping_run_once_on_the_accumulated_gradients(project):
    path = project(
        base_config(
            precision={"dtype": "float16", "init_scale": 1024.0},
            clip_grad_norm=1e-3,
            grad_accum_steps=2,
            data_args={"batches": 4},
        )
    )
    session = build_session(load_config(path))
    _, batch = next(iter(session.batches))
    ctx = run_step(session, 0, batch, Probe())
    assert ctx.grad_norm is not None  # clipping measured the unscaled, accumulated grads
    assert float(ctx.grad_norm) < 100  # not still multiplied by the scale of 1024
    assert ctx.grad_scale is None  # the last micro-batch's gradients were unscaled


@pytest.mark.parametrize("clip", [None, 100.0], ids=["unclipped", "clipped"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_sentinel_reads_the_norm_of_the_accumulated_unscaled_gradients(project, dtype, clip):
    path = project(
        base_config(
            precision={"dtype": dtype},
            clip_grad_norm=clip,
            grad_accum_steps=2,
            data_args={"batches": 4},
        )
    )
    session = build_session(load_config(path))
    sentinel = Sentinel(session)
    _, batch = next(iter(session.batches))
    grads: list[torch.Tensor] = []

    class Unscaled(Probe):  # the gradients as the optimizer is about to use them
        def phase_started(self, ctx, phase):
            if phase is Phase.OPTIMIZER:
                grads.extend(p.grad.clone() for p in session.params)

    run_step(session, 0, batch, Probes(sentinel, Unscaled()))
    (verdict,) = sentinel.collect(final=True)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]).double())
    assert verdict.reading.grad_norm == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("packed", [False, True], ids=["read-at-once", "packed"])
def test_the_steps_loss_is_the_mean_of_its_micro_batches_losses(project, packed):
    """As a trainer logs it: the last micro-batch's alone made the curve jump by batch.
    `packed`: the way of a CUDA device (and of ranks), the losses kept on the device."""
    path = project(base_config(grad_accum_steps=2, data_args={"batches": 4}))
    session = build_session(load_config(path))
    sentinel = Sentinel(session)
    if packed:
        sentinel.defer, sentinel._at_once = False, (session.device, False)
    _, batch = next(iter(session.batches))
    losses: list[float] = []

    class Losses(Probe):
        def phase_ended(self, ctx, phase):
            if phase is Phase.LOSS:
                losses.append(float(ctx.loss.detach()))

    run_step(session, 0, batch, Probes(sentinel, Losses()))
    (verdict,) = sentinel.collect(final=True)
    assert len(losses) == 2 and losses[0] != losses[1]
    assert verdict.reading.loss == pytest.approx(sum(losses) / 2, rel=1e-6)


def test_compare_counts_optimizer_steps_too(project):
    config = base_config(data_args={"batches": 40, "nan_at": 37}, grad_accum_steps=4, steps=12)
    comparison = compare(load_config(project(config)), [])
    assert comparison.runs[0].first_nonfinite_step == 9


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text)


def _mark_batch(train_py, index: int) -> None:
    """Make batch `index` of train.py's data carry the marker 123.0 in x[0, 0]."""
    text = train_py.read_text()
    text = text.replace(
        "        out.append((x, torch.randint(0, classes, (batch_size,), generator=g)))",
        f"        if i == {index}:\n            x[0, 0] = 123.0\n"
        "        out.append((x, torch.randint(0, classes, (batch_size,), generator=g)))",
    )
    train_py.write_text(text)


def test_probes_pass_an_aborted_step_to_each_probe_that_judges_one():
    """A run that ends inside a step (`StepHooks.abort`) has it judged by the probes
    that judge such steps, whatever else rides along (the learning-rate history)."""

    class Judging(Probe):
        def __init__(self):
            self.aborted: list[int] = []

        def step_aborted(self, ctx):
            self.aborted.append(ctx.step)

    judging = Judging()
    Probes(Probe(), judging).step_aborted(types.SimpleNamespace(step=7))
    assert judging.aborted == [7]
