"""runtime.tensors: the norms (and sums of squares) the sentinel reads every step,
whatever the tensors are, and the private copies of the batches the snapshots keep."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import BatchEncoding

from nandoctor.runtime.tensors import (
    additive_mask,
    host_copy,
    host_square_sums,
    iter_tensors,
    nonfinite_data,
    square_sums,
    tensor_norms,
    total_norm,
    wide_norm,
)


def expected(tensors: list[torch.Tensor]) -> list[float]:
    def real(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        t = t.coalesce().values() if t.is_sparse else t
        return torch.view_as_real(t) if t.is_complex() else t

    return sorted(torch.linalg.vector_norm(real(t).double()).item() for t in tensors)


GRADIENT_LISTS = {
    "one dtype (a model's gradients)": [torch.randn(64, 32), torch.randn(32), torch.randn(7)],
    "large and small": [torch.randn(256, 256), torch.randn(256), torch.randn(300, 300).t()],
    "float64": [torch.randn(5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)],
    "float16 and float32": [torch.randn(8).half(), torch.randn(8)],
    "one requires grad": [torch.randn(4), torch.randn(4, requires_grad=True)],
    "complex": [torch.randn(4, dtype=torch.complex64), torch.randn(4, dtype=torch.complex64)],
    "sparse": [torch.randn(4, 4).to_sparse(), torch.randn(4)],
    "a parameter": [torch.nn.Parameter(torch.randn(3)), torch.randn(3)],
}


@pytest.mark.parametrize("tensors", GRADIENT_LISTS.values(), ids=GRADIENT_LISTS.keys())
def test_each_tensors_norm_whatever_its_kind(tensors):
    norms = tensor_norms(tensors)
    assert sorted(n.item() for n in norms) == pytest.approx(expected(tensors), rel=1e-3)
    assert not any(n.requires_grad for n in norms)  # measured outside autograd


def test_half_precision_norms_are_accumulated_in_float32_and_float64_ones_in_float64():
    big = torch.full((4,), 60000.0, dtype=torch.float16)  # its norm, 120000, is past float16
    (norm,) = tensor_norms([big])
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(120000.0)
    (norm,) = tensor_norms([torch.ones(4, dtype=torch.float64)])
    assert norm.dtype == torch.float64


def test_a_nan_or_inf_makes_its_norm_non_finite_and_the_total_too():
    for bad in (float("nan"), float("inf")):
        grads = [torch.ones(3), torch.tensor([1.0, bad])]
        assert not torch.isfinite(torch.stack(tensor_norms(grads))).all()
        assert not torch.isfinite(total_norm(grads, torch.device("cpu")))


@pytest.mark.parametrize("tensors", GRADIENT_LISTS.values(), ids=GRADIENT_LISTS.keys())
def test_each_tensors_sum_of_squares_is_its_norm_squared_whatever_its_kind(tensors):
    squares = square_sums(tensors)
    norms = sorted(math.sqrt(s.item()) for s in squares)
    assert norms == pytest.approx(expected(tensors), rel=1e-3)
    assert not any(s.requires_grad for s in squares)


@pytest.mark.parametrize("numel", [2, 2**16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_nan_or_inf_makes_its_sum_of_squares_non_finite(dtype, numel):
    for bad in (float("nan"), float("inf"), -float("inf")):
        grad = torch.ones(numel, dtype=dtype)
        grad[-1] = bad
        squares = square_sums([torch.ones(3, dtype=dtype), torch.ones(numel, dtype=dtype), grad])
        assert sorted(torch.isfinite(torch.stack(squares)).tolist()) == [False, True, True]


HOST_LISTS = {
    "float32, small and large": [torch.randn(64, 32), torch.randn(32), torch.randn(2**16)],
    "float64": [torch.randn(5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)],
    "transposed": [torch.randn(300, 200).t(), torch.randn(7)],
    "empty": [torch.randn(0), torch.randn(3)],
}


@pytest.mark.parametrize("tensors", HOST_LISTS.values(), ids=HOST_LISTS.keys())
def test_cpu_float_sums_of_squares_are_read_on_the_host_in_order(tensors):
    sums = host_square_sums(tensors)
    assert sums is not None and all(type(s) is float for s in sums)
    wanted = [torch.linalg.vector_norm(t.double()).item() ** 2 for t in tensors]
    assert sums == pytest.approx(wanted, rel=1e-5)


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.randn(4).bfloat16()],  # accumulated in float32 by the fused norms
        [torch.randn(4), torch.randn(4, dtype=torch.float64)],  # one kind only
        [torch.randn(4, requires_grad=True)],  # inside autograd: not a gradient
        [torch.randn(4, 4).to_sparse()],
        [torch.randn(4, dtype=torch.complex64)],
    ],
    ids=["bfloat16", "mixed", "requires grad", "sparse", "complex"],
)
def test_other_kinds_of_tensors_are_left_to_the_fused_norms(tensors):
    assert host_square_sums(tensors) is None


@pytest.mark.parametrize("numel", [5, 2**16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_nan_or_inf_makes_its_host_sum_non_finite_and_huge_values_overflow_only_float32(
    dtype, numel
):
    for bad in (float("nan"), float("inf"), -float("inf")):
        grad = torch.ones(numel, dtype=dtype)
        grad[-1] = bad
        sums = host_square_sums([torch.ones(3, dtype=dtype), grad])
        assert sums is not None and math.isfinite(sums[0]) and not math.isfinite(sums[1])
    (huge,) = host_square_sums([torch.full((numel,), 1e20, dtype=dtype)]) or [math.nan]
    assert math.isinf(huge) == (dtype == torch.float32)  # the sentinel rechecks an inf sum


BATCHES = {
    "a tuple of tensors (the common batch)": (torch.randn(4, 3), torch.arange(4)),
    "a list of tensors": [torch.randn(2, 2), torch.randn(3).t()],
    "a tuple with a float": (torch.randn(3), 0.5),
    "one that requires grad": (torch.randn(3), torch.randn(3, requires_grad=True)),
    "nested": ((torch.randn(2),), {"y": torch.arange(2)}),
    "a parameter": (torch.nn.Parameter(torch.randn(2), requires_grad=False), torch.randn(2)),
}


@pytest.mark.parametrize("batch", BATCHES.values(), ids=BATCHES.keys())
def test_a_kept_batch_is_a_private_copy_of_the_same_shape_that_later_writes_leave_alone(batch):
    kept = host_copy(batch)
    assert type(kept) is type(batch)
    originals = list(iter_tensors(batch))
    copies = list(iter_tensors(kept))
    assert len(copies) == len(originals)
    for original, copy in zip(originals, copies, strict=True):
        assert copy.data_ptr() != original.data_ptr()
        assert copy.stride() == original.stride() and not copy.requires_grad
        torch.testing.assert_close(copy, original.detach())
    for original in originals:
        with torch.no_grad():
            original.add_(1)  # the loss, or the data pipeline, writing in place
    for original, copy in zip(originals, copies, strict=True):
        torch.testing.assert_close(copy + 1, original.detach())


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


ALIKE = {
    "a tuple of tensors": lambda: (torch.randn(4, 3), torch.arange(4)),
    "a dict of tensors": lambda: {"input_ids": torch.arange(6).view(2, 3), "x": torch.randn(2)},
    "a transposed tensor": lambda: [torch.randn(3, 5).t()],
    "a nested batch": lambda: ((torch.randn(2),), {"y": torch.arange(2)}),
    "a dataclass": lambda: Pair(torch.randn(2), torch.randn(2)),
    "transformers' BatchEncoding": lambda: BatchEncoding({"input_ids": torch.arange(6)}),
    "a tensor that requires grad": lambda: (torch.randn(2, requires_grad=True),),
}


@pytest.mark.parametrize("make", ALIKE.values(), ids=ALIKE.keys())
def test_a_batch_laid_out_as_a_dropped_copy_is_copied_into_its_buffers(make):
    dropped, batch = host_copy(make()), make()
    buffers = [t.data_ptr() for t in iter_tensors(dropped)]
    kept = host_copy(batch, reuse=dropped)
    assert type(kept) is type(batch)
    assert [t.data_ptr() for t in iter_tensors(kept)] == buffers  # no new allocation
    for copy, original in zip(iter_tensors(kept), iter_tensors(batch), strict=True):
        assert torch.equal(copy, original) and copy.stride() == original.stride()
        assert copy.data_ptr() != original.data_ptr() and not copy.requires_grad


UNLIKE = {
    "another shape": ((torch.randn(4, 3),), (torch.randn(5, 3),)),
    "another dtype": ((torch.randn(4),), (torch.randn(4).double(),)),
    "other strides": ((torch.randn(3, 3),), (torch.randn(3, 3).t(),)),
}


@pytest.mark.parametrize(("first", "then"), UNLIKE.values(), ids=UNLIKE.keys())
def test_a_tensor_laid_out_otherwise_gets_a_buffer_of_its_own(first, then):
    dropped = host_copy(first)
    values = [t.clone() for t in iter_tensors(dropped)]
    kept = host_copy(then, reuse=dropped)
    (copy,), (original,) = kept, then
    assert torch.equal(copy, original) and copy.stride() == original.stride()
    assert copy.data_ptr() not in (original.data_ptr(), dropped[0].data_ptr())
    assert all(torch.equal(a, b) for a, b in zip(iter_tensors(dropped), values, strict=True))


def test_buffers_are_lent_in_order_to_the_tensors_laid_out_alike_and_the_rest_are_new():
    dropped = host_copy((torch.randn(2), torch.randn(3)))
    batch = [torch.randn(2), torch.randn(4), torch.randn(5)]  # another container and length
    kept = host_copy(batch, reuse=dropped)
    assert type(kept) is list and all(torch.equal(a, b) for a, b in zip(kept, batch, strict=True))
    assert kept[0].data_ptr() == dropped[0].data_ptr()
    assert dropped[1].data_ptr() not in (t.data_ptr() for t in kept)


def test_a_norm_in_float64_stays_finite_where_float32_squares_overflow():
    grads = [torch.full((3,), 1e20), torch.full((2, 2), -1e20)]
    assert math.isinf(total_norm(grads, torch.device("cpu")).item())
    assert wide_norm(grads) == pytest.approx(1e20 * math.sqrt(7), rel=1e-6)


def masks() -> dict[str, torch.Tensor]:
    inf = float("-inf")
    return {
        "mask": torch.tensor([[0.0, inf], [inf, inf]]),
        "mask with a NaN": torch.tensor([[0.0, inf], [float("nan"), inf]]),
        "mask with a +inf": torch.tensor([[0.0, inf], [float("inf"), 0.0]]),
        "-inf among data": torch.tensor([[0.5, inf], [1.0, 0.0]]),
        "clean data": torch.tensor([[0.5, 2.0]]),
    }


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_is_bad_data_for_any_non_finite_value_but_an_additive_masks(device):
    """A 0/-inf attention mask's -inf are deliberate; a NaN or +inf in it, or a -inf among
    other values, is bad data. The CPU judges on the host, CUDA on the device, alike."""
    device = torch.device(device)
    tensors = {k: v.to(device) for k, v in masks().items()}
    assert additive_mask(tensors["mask"]) and not additive_mask(tensors["-inf among data"])
    bad = {k: bool(nonfinite_data([v, tensors["clean data"]], device)) for k, v in tensors.items()}
    assert bad == {
        "mask": False,
        "mask with a NaN": True,
        "mask with a +inf": True,
        "-inf among data": True,
        "clean data": False,
    }
