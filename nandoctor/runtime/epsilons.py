"""Epsilons a dtype loses, and the ones the eps-underflow what-if puts in their place.

An epsilon reaches an op as a plain number (`var + 1e-8`), or as a tensor: a buffer
(`register_buffer("eps", torch.tensor(1e-8))`), a one-element constant, or a fill
(`torch.full_like(n, 1e-8)`, the scalar `torch.where(c, n, 1e-8)` makes). Either way,
in a dtype that holds it as exactly 0 it guards nothing. `raised` gives its replacement:
the dtype's smallest normal number (6.1e-05 in float16), of the same kind (a number for a
number, a tensor for a tensor), or None for an epsilon the dtype holds.
"""

from __future__ import annotations

from typing import Any

import torch


def too_small(value: Any, dtype: torch.dtype | None) -> bool:
    """A nonzero number that `dtype` rounds to exactly 0 (1e-8 in float16)."""
    if dtype is None or not isinstance(value, float) or not dtype.is_floating_point or value == 0:
        return False
    return float(torch.tensor(value, dtype=dtype)) == 0.0


def raised(value: Any, dtype: torch.dtype | None) -> Any:
    """`value`, an epsilon `dtype` rounds to 0, as the dtype's smallest normal number; None
    when it is no such epsilon. A tensor counts when it is a constant of one element (NB:
    a value that requires grad is a weight or a loss, never an epsilon; read only then)."""
    if dtype is None or not dtype.is_floating_point:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad or not value.is_floating_point():
            return None
        if not too_small(float(value.detach().reshape(())), dtype):
            return None
        return torch.full_like(value, torch.finfo(dtype).tiny)
    return torch.finfo(dtype).tiny if too_small(value, dtype) else None


def result_dtype(a: Any, b: Any) -> torch.dtype | None:
    """The dtype an op of `a` and `b` computes in (a float16 tensor and a float32 0-dim
    buffer: float16, where the buffer's 1e-8 is lost)."""
    try:
        return torch.result_type(a, b)
    except (TypeError, RuntimeError):
        return None
