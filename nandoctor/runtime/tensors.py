"""Small tensor helpers the loop and the probes share: walking batches, fused norms.

Every reduction here stays on the device and returns a 0-dim tensor: reading it on the
host is the caller's decision (and its one synchronisation per step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
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


def map_tensors(
    obj: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] = lambda x: x
) -> Any:
    """`fn` on every tensor of a batch, `other` on every other leaf; containers kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn, other)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn, other) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, other) for v in obj)
    return other(obj)


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor of a batch to `device`, keeping the container types."""
    return map_tensors(obj, lambda t: t.to(device, non_blocking=True))


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
            norms.extend(_foreach_norm(group, ord, dtype))
        else:
            norms.extend(torch.linalg.vector_norm(t, ord, dtype=dtype) for t in group)
    return norms


def _foreach_norm(group: list[torch.Tensor], ord: float, dtype: torch.dtype) -> list[torch.Tensor]:
    # NB: the fused kernel's `dtype` argument is recent, and some (device, dtype) pairs
    # lack it: then one kernel per tensor, same result
    try:
        return list(torch._foreach_norm(group, ord, dtype=dtype))
    except (RuntimeError, TypeError, NotImplementedError):
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in group]


def total_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The global L2 norm of `tensors`, accumulated in float32, for telemetry.

    NB: finite values beyond ~1e19 overflow float32 squares: this norm is then inf. It is
    never the finite check: `nonfinite` is, exactly.
    """
    if not tensors:
        return torch.zeros((), device=device)
    norms = _grouped_norms(tensors, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


def nonfinite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """True (a 0-dim bool on `device`) when any element of `tensors` is NaN or inf.

    Exact, unlike a norm or a sum, which finite values can overflow. NB: the fastest form
    differs by device: on the CPU, each tensor's min and max (NaN propagates into both);
    on CUDA, one fused float64 L1 norm per dtype group instead of a kernel per tensor.
    """
    tensors = [
        t.detach() for t in tensors if (t.is_floating_point() or t.is_complex()) and t.numel()
    ]
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    if device.type == "cpu":
        extremes = [v.float() for t in tensors for v in torch.aminmax(_real(t))]
        return ~torch.isfinite(torch.stack(extremes)).all()
    sums = _grouped_norms(tensors, 1.0, torch.float64)
    return ~torch.isfinite(torch.stack([s.to(device) for s in sums])).all()


def gradient_check(
    grads: Sequence[torch.Tensor], device: torch.device, clip_norm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(global L2 norm, any NaN or inf) of the gradients, the check exact.

    NB: a norm's squares overflow for huge finite gradients (~1e19 and up), so a norm is
    never the check by itself. On CUDA one fused float64 pass gives both (float64 squares
    hold up to 1e154); on the CPU, where float64 norms are slow, a float32 norm (clip's,
    when it made one) for telemetry and an exact `nonfinite` pass.
    """
    if device.type == "cuda" and grads:
        norm = torch.linalg.vector_norm(torch.stack(_grouped_norms(grads, 2.0, torch.float64)))
        return norm, ~torch.isfinite(norm)
    norm = clip_norm.detach() if clip_norm is not None else total_norm(grads, device)
    return norm, nonfinite(grads, device)


def _real(t: torch.Tensor) -> torch.Tensor:
    return t.abs() if t.is_complex() else t.reshape(-1) if t.dim() == 0 else t
