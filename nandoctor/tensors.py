"""Small tensor helpers the loop and the probes share: walking batches, fused norms.

Every reduction here stays on the device and returns a 0-dim tensor: reading it on the
host is the caller's decision (and its one synchronisation per step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses (model outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def floating(tensors: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(tensors) if t.is_floating_point() or t.is_complex()]


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor of a batch to `device`, keeping the container types."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def _grouped_norms(
    tensors: Sequence[torch.Tensor], ord: float, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Per-tensor norms accumulated in `dtype`, one fused kernel per (device, dtype) group."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t.detach())
    norms: list[torch.Tensor] = []
    for (device, _), group in groups.items():
        if device.type in ("cpu", "cuda") and not group[0].is_sparse:
            # NB: reduced-precision norms are accumulated in float32: the L2 norm of finite
            # float16 values overflows float16 long before the values do.
            norms.extend(torch._foreach_norm(group, ord, dtype=dtype))
        else:
            norms.extend(torch.linalg.vector_norm(t, ord, dtype=dtype) for t in group)
    return norms


def total_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The global L2 norm of `tensors`: NaN or inf exactly when an element is.

    NB: accumulated in float64. In float32 the squares of finite values near 1e19
    overflow, and a diverging run's huge but finite gradients would read as non-finite.
    """
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = _grouped_norms(tensors, 2.0, torch.float64)
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


def absmax(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The largest |x| over `tensors`: NaN or inf when any element is, never an overflow."""
    if not tensors:
        return torch.zeros((), device=device)
    norms = _grouped_norms(tensors, float("inf"))
    return torch.stack([n.to(device) for n in norms]).max()
