"""Steps run again: a `Guard`'s kept step holds a private host copy of its arguments,
and a kept step the snapshot store dropped lends its buffers to the next one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import BatchEncoding

from nandoctor.runtime.rerun import KeptStep
from nandoctor.runtime.tensors import iter_tensors


def step_fn(x, y, *, scale):
    return x * scale + y


def tensors_of(kept: KeptStep) -> list[torch.Tensor]:
    return list(iter_tensors(kept.call))


def test_a_kept_step_is_a_private_copy_of_its_arguments():
    x, y = torch.randn(4, 3), torch.arange(4)
    kept = KeptStep.of(step_fn, (x, y), {"scale": 2.0})
    x.add_(1)  # the step, or the data pipeline, writing in place
    (x2, y2), kwargs = kept.arguments()
    torch.testing.assert_close(x2 + 1, x)
    assert torch.equal(y2, y) and kwargs == {"scale": 2.0}


def test_a_dropped_kept_step_lends_its_buffers_to_arguments_laid_out_alike():
    old = KeptStep.of(step_fn, (torch.randn(4, 3), torch.arange(4)), {"scale": 2.0})
    buffers = [t.data_ptr() for t in tensors_of(old)]
    x, y = torch.randn(4, 3), torch.arange(4, 8)
    kept = KeptStep.of(step_fn, (x, y), {"scale": 3.0}, reuse=old)
    assert [t.data_ptr() for t in tensors_of(kept)] == buffers
    (x2, y2), kwargs = kept.arguments()
    assert torch.equal(x2, x) and torch.equal(y2, y)
    assert kwargs == {"scale": 3.0}  # the values that are not tensors are this step's


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    note: str


ARGUMENTS = {
    "transformers' BatchEncoding": lambda: BatchEncoding({"input_ids": torch.arange(6)}),
    "a dataclass": lambda: Batch(torch.randn(3), "kept as it is"),
    "a dict in a list": lambda: [{"x": torch.randn(2, 2)}],
}


@pytest.mark.parametrize("make", ARGUMENTS.values(), ids=ARGUMENTS)
def test_tensors_inside_any_batch_container_are_copied_and_their_buffers_reused(make):
    batch = make()
    kept = KeptStep.of(step_fn, (batch,), {})
    original = [t.clone() for t in iter_tensors(batch)]
    for t in iter_tensors(batch):
        t.add_(1)  # the step writing into its batch
    (again,), _ = kept.arguments()
    assert type(again) is type(batch) and again is not batch
    assert all(torch.equal(a, b) for a, b in zip(iter_tensors(again), original, strict=True))
    buffers = [t.data_ptr() for t in tensors_of(kept)]
    later = KeptStep.of(step_fn, (make(),), {}, reuse=kept)
    assert [t.data_ptr() for t in tensors_of(later)] == buffers


def test_a_tensor_that_requires_grad_is_the_models_own_and_kept_as_it_is():
    weight = torch.nn.Parameter(torch.randn(3))
    kept = KeptStep.of(step_fn, (weight, torch.randn(3)), {"scale": 2.0})
    (w, x), _ = kept.arguments()
    assert w is weight and x is not kept.call[0][1]  # the replay trains the model itself
    later = KeptStep.of(step_fn, (torch.randn(3), torch.randn(3)), {"scale": 2.0}, reuse=kept)
    assert later.call[0][0].data_ptr() != weight.data_ptr()  # never lent as a buffer


CALLS_LAID_OUT_OTHERWISE = {
    "another shape": ((torch.randn(5, 3), torch.arange(4)), {"scale": 2.0}),
    "other strides": ((torch.randn(3, 4).t(), torch.arange(4)), {"scale": 2.0}),
    "another dtype": ((torch.randn(4, 3).double(), torch.arange(4)), {"scale": 2.0}),
}


@pytest.mark.parametrize("call", CALLS_LAID_OUT_OTHERWISE.values(), ids=CALLS_LAID_OUT_OTHERWISE)
def test_arguments_laid_out_otherwise_get_new_buffers_and_the_dropped_step_is_untouched(call):
    args, kwargs = call
    old = KeptStep.of(step_fn, (torch.randn(4, 3), torch.arange(4)), {"scale": 2.0})
    before = [t.clone() for t in tensors_of(old)]
    kept = KeptStep.of(step_fn, args, kwargs, reuse=old)
    x = args[0]
    assert torch.equal(tensors_of(kept)[0], x) and tensors_of(kept)[0].stride() == x.stride()
    assert tensors_of(kept)[0].data_ptr() != tensors_of(old)[0].data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(old), before, strict=True))
