"""Steps run again: a `Guard`'s kept step holds a private host copy of its arguments,
and a kept step the snapshot store dropped lends its buffers to the next one."""

from __future__ import annotations

import pytest
import torch

from nandoctor.runtime.rerun import KeptStep


def step_fn(x, y, *, scale):
    return x * scale + y


def tensors_of(kept: KeptStep) -> list[torch.Tensor]:
    return [t for t in kept.leaves if isinstance(t, torch.Tensor)]


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


CALLS_LAID_OUT_OTHERWISE = {
    "another shape": ((torch.randn(5, 3), torch.arange(4)), {"scale": 2.0}),
    "other strides": ((torch.randn(3, 4).t(), torch.arange(4)), {"scale": 2.0}),
    "another dtype": ((torch.randn(4, 3).double(), torch.arange(4)), {"scale": 2.0}),
    "another structure": ((torch.randn(4, 3),), {"y": torch.arange(4), "scale": 2.0}),
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
