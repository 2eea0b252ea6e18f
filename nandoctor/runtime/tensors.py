"""Small tensor helpers the loop and the probes share: walking batches, fused norms.

Every reduction here stays on the device and returns a 0-dim tensor: reading it on the
host is the caller's decision (and its one synchronisation per step). The one exception,
`host_square_sums`, is the CPU's, where there is no device to wait for.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a batch or a model output, in order (see `named_tensors`).
    NB: its own walk, not `named_tensors` less the names: the sentinel walks each step's
    batch, and building paths nobody reads costs more than the check on a small batch."""
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    for _, value in _parts(obj):
        yield from iter_tensors(value)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor inside `obj` (a batch, a state dict), as `iter_tensors` finds them."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


def named_tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor with its path: `0`, `labels`, `0.input_ids`; "" for a lone tensor.

    Containers are tuples and lists (by index), mappings (by key: dicts, transformers'
    `BatchEncoding`, a `UserDict`) and dataclasses (by field). A `ModelOutput` is both a
    mapping and a dataclass: as a mapping it shows only the fields that were set.
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    for key, value in _parts(obj):
        yield from named_tensors(value, f"{path}.{key}" if path else key)


def _parts(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield str(key), value
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield str(i), value
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield f.name, getattr(obj, f.name)


def call_inputs(args: tuple, kwargs: dict) -> Any:
    """A call's arguments as one structure whose paths name them: positional ones by
    index, keyword ones by name (`0`, `0.x`, `labels`): `model(**batch)` passes its
    whole batch by keyword."""
    if not kwargs:
        return args
    return {**{str(i): a for i, a in enumerate(args)}, **kwargs}


def floating(tensors: Any) -> list[torch.Tensor]:
    return [t for t in iter_tensors(tensors) if t.is_floating_point() or t.is_complex()]


def without_loss(output: Any) -> Any:
    """A model's output without the loss it carries (`ModelOutput.loss`, a dict's "loss"):
    that loss is judged as the loss, in its own phase, apart from the logits beside it."""
    if isinstance(output, Mapping) and "loss" in output:
        return [value for key, value in output.items() if key != "loss"]
    return output


def map_tensors(
    obj: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] = lambda x: x
) -> Any:
    """`fn` on every tensor of a batch, `other` on every other leaf; containers kept (the
    same types as `named_tensors` walks, each rebuilt as its own type)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn, other) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, other) for v in obj)
    if isinstance(obj, Mapping):
        return _mapped_mapping(obj, {k: map_tensors(v, fn, other) for k, v in obj.items()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            # NB: object.__setattr__ also fills frozen dataclasses and init=False fields
            object.__setattr__(out, f.name, map_tensors(getattr(obj, f.name), fn, other))
        return out
    return other(obj)


def host_copy(batch: Any, reuse: Any = None) -> Any:
    """A private host copy of a batch: a user's loss may modify its batch in place, and a
    kept batch must stay as the run saw it, replay after replay. `reuse`: an earlier copy
    no longer kept, whose buffers the copy's tensors take where laid out alike
    (`HostBuffers`).

    NB: what cannot be copied is kept as it is: a meta tensor (no data), a lock or an open
    file in a batch field (deepcopy refuses them); the replay then sees the same object."""
    buffers = HostBuffers(reuse)
    if type(batch) in _FLAT and all(_clones(t) for t in batch):
        # NB: the common batch, kept every step, where the caches are cold: the walk
        # below added 10-25 us to its copies in situ (6 ms steps, docs/performance.md)
        return type(batch)([buffers.copy(t, torch.Tensor.clone) for t in batch])
    return map_tensors(batch, lambda t: buffers.copy(t, _tensor_copy), _leaf_copy)


class HostBuffers:
    """The host tensors of a copy no longer kept (a batch, a step's arguments), lent in
    order to the tensors of the next copy: each one laid out as the next of them (the same
    shape, dtype and strides) is copied into its buffer, any other gets a new one.

    NB: so that a run whose batches are all alike keeps each in the buffers of one no
    longer kept, instead of allocating a new copy every step: a fresh 100 KB image batch a
    step cost ~2% of the benchmark convnet's 7 ms step in situ, a 38 MB one 14-77 ms, and
    a large batch faults in its pages again every step. Only the copy's own tensors are
    lent (host tensors outside autograd: never one a copy kept as it was, a parameter)."""

    __slots__ = ("_free",)

    def __init__(self, old: Any = None) -> None:
        if type(old) in _FLAT and all(_clones(t) for t in old):  # NB: as `host_copy`'s
            self._free = iter(old)
        else:
            self._free = iter([t for t in iter_tensors(old) if _clones(t)])

    def copy(self, t: torch.Tensor, new: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`t` copied into the next free buffer if it is laid out alike, else `new(t)` (a
        CUDA tensor's copy is non-blocking: the caller waits for it, as for a new copy)."""
        kept = next(self._free, None)
        if kept is None or not _alike(kept, t):
            return new(t)
        kept.copy_(t.detach(), non_blocking=t.is_cuda)
        return kept


_FLAT = (tuple, list)


def _alike(kept: Any, t: torch.Tensor) -> bool:
    """NB: the same strides too: a replay computes on the layout the run saw (a clone of
    a dense tensor keeps its strides; of any other, it is contiguous, and differs)."""
    return (
        isinstance(kept, torch.Tensor)
        and kept.shape == t.shape
        and kept.dtype == t.dtype
        and kept.stride() == t.stride()
    )


def _clones(t: Any) -> bool:
    """A host tensor outside autograd, copied by a clone: one kernel call, not a detached
    view and a copy (NB: the common case, every step)."""
    return isinstance(t, torch.Tensor) and t.is_cpu and not t.requires_grad


def _tensor_copy(t: torch.Tensor) -> torch.Tensor:
    if t.is_meta:
        return t
    if _clones(t):
        return t.clone()
    return t.detach().to("cpu", copy=True)


def _leaf_copy(leaf: Any) -> Any:
    try:
        return copy.deepcopy(leaf)
    except Exception:
        return leaf


def _mapped_mapping(obj: Mapping, values: dict) -> Any:
    """`obj`'s own type holding `values`: a copy with its items replaced (a `ModelOutput`
    or a `BatchEncoding` keeps its attributes), or a plain dict for a read-only mapping."""
    if not isinstance(obj, MutableMapping):
        return values
    out = copy.copy(obj)
    for key, value in values.items():
        out[key] = value
    return out


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor of a batch to `device`, keeping the container types (a
    meta tensor holds no data to move: it stays as it is)."""
    return map_tensors(obj, lambda t: t if t.is_meta else t.to(device, non_blocking=True))


def _grouped_norms(
    tensors: Sequence[torch.Tensor], ord: float, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Per-tensor norms accumulated in `dtype`, one fused kernel per (device, dtype) group.

    NB: the common case (a model's gradients: plain tensors of one device and dtype) is
    recognised in one pass, without a Python call per tensor: the sentinel measures them
    every step, where each call meets caches the step's kernels have just emptied."""
    kind = _one_plain_kind(tensors)
    if kind is not None and not kind[1].is_complex and kind[0].type in ("cpu", "cuda"):
        return _foreach_norm(list(tensors), ord, _accumulated_in(kind[1], dtype))
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        t = _values(t)
        groups.setdefault((t.device, t.dtype), []).append(t)
    norms: list[torch.Tensor] = []
    for (device, group_dtype), group in groups.items():
        acc = _accumulated_in(group_dtype, dtype)
        if device.type in ("cpu", "cuda"):
            norms.extend(_foreach_norm(group, ord, acc))
        else:
            norms.extend(torch.linalg.vector_norm(t, ord, dtype=acc) for t in group)
    return norms


def _one_plain_kind(tensors: Sequence[torch.Tensor]) -> tuple[torch.device, torch.dtype] | None:
    """The one (device, dtype) of `tensors` when all are plain strided tensors outside
    autograd (a model's gradients), found in one pass; else None."""
    kinds = {(type(t), t.layout, t.device, t.dtype, t.requires_grad) for t in tensors}
    if len(kinds) != 1:
        return None
    kind, layout, device, dtype, needs_grad = next(iter(kinds))
    plain = kind is torch.Tensor and layout == torch.strided and not needs_grad
    return (device, dtype) if plain else None


def _accumulated_in(values: torch.dtype, wanted: torch.dtype) -> torch.dtype:
    """NB: a norm is never accumulated in fewer bits than its values (float64 weights);
    reduced-precision values are accumulated in (at least) float32: the L2 norm of finite
    float16 values overflows float16 long before the values do."""
    return torch.float64 if torch.float64 in (values, wanted) else wanted


def _values(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values to reduce: this rank's, strided and real, outside autograd (NB: a
    detach only where needed: a gradient or a batch never requires grad)."""
    t = local(t)
    return _plain(t.detach() if t.requires_grad else t)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A strided real tensor with the same values (for norms and finite checks): a sparse
    tensor's stored values, a complex tensor's real and imaginary parts side by side."""
    if t.layout != torch.strided:
        t = t.coalesce().values() if t.layout == torch.sparse_coo else t.values()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t


def _foreach_norm(group: list[torch.Tensor], ord: float, dtype: torch.dtype) -> list[torch.Tensor]:
    # NB: the fused kernel's `dtype` argument is recent, and some (device, dtype) pairs
    # lack it: then one kernel per tensor, same result
    try:
        return list(torch._foreach_norm(group, ord, dtype=dtype))
    except (RuntimeError, TypeError, NotImplementedError):
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in group]


def tensor_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's L2 norm (in no fixed order), accumulated in at least float32: one
    fused kernel per (device, dtype) group, whatever the number of tensors."""
    return _grouped_norms(tensors, 2.0)


def square_sums(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's sum of squares (0-dim, in no fixed order), accumulated in at least
    float32: NaN or inf exactly when the tensor's norm is, and the norm once summed. One
    fused kernel per (device, dtype) group (see `host_square_sums` for the CPU's way)."""
    return _squared_norms(tensors)


def host_square_sums(tensors: Sequence[torch.Tensor]) -> list[float] | None:
    """Each tensor's sum of squares, read on the host, for plain CPU float32 or float64
    tensors (None for any other kind): NaN or inf exactly when the tensor's norm is.

    NB: the sentinel measures every gradient every step, right after the backward, where
    every call meets caches the backward has just emptied: there, what counts is which
    code runs, more than how much. Torch's dot, read at once, runs the dispatch the
    backward has just run; any other path starts cold. Measured in situ on the
    benchmark's float32 MLP (ten gradients): 0.12 ms a step, against 0.17 ms with numpy's
    dot for the small ones (its first call alone costs ~45 us), 0.14 ms for the same dots
    stacked and read once, 0.19 ms for the fused norms. float32 accumulates in float32:
    finite values of ~1e19 and up overflow it (the caller rechecks an infinite sum)."""
    kind = _one_plain_kind(tensors)
    if kind is None or kind[0].type != "cpu" or kind[1] not in (torch.float32, torch.float64):
        return None
    sums = []
    for t in tensors:
        flat = t.reshape(-1)
        sums.append(torch.dot(flat, flat).item())
    return sums


def _squared_norms(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    norms = _grouped_norms(tensors, 2.0)
    return list(torch._foreach_mul(norms, norms)) if norms else []


def total_norm(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The global L2 norm of `tensors`, accumulated in float32, for telemetry.

    NB: finite values beyond ~1e19 overflow float32 squares: this norm is then inf. It is
    never the finite check: `nonfinite` is, exactly.
    """
    if not tensors:
        return torch.zeros((), device=device)
    norms = _grouped_norms(tensors, 2.0)
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


def additive_mask(t: torch.Tensor) -> bool:
    """An additive attention mask a batch carries: 0 where a position is kept, -inf where
    it is masked, and nothing else. Its infs are deliberate, as a mask buffer's are: a
    softmax sums them out, and the NaN of a row masked entirely is the softmax's
    (fully-masked-softmax), not bad data. NB: a NaN, a +inf or any other value makes the
    tensor's non-finite values data again (nonfinite-input)."""
    if t.is_meta or t.is_sparse or not t.is_floating_point():
        return False
    return bool(((t == 0) | (t == float("-inf"))).all())


def nonfinite_data(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """`nonfinite` for a batch: NaN or inf in a tensor that is not an additive mask (a 0
    and -inf mask's infs are deliberate: `additive_mask`). A 0-dim bool on `device`, read
    on the host only when a step failed on the CPU; on other devices judged there, per
    tensor, without a host read (the step's flags are read together, later)."""
    if device.type == "cpu":  # NB: a mask is looked for only in a non-finite tensor
        bad = any(bool(nonfinite([t], device)) and not additive_mask(t) for t in tensors)
        return torch.tensor(bad, device=device)
    flags = [nonfinite([t], device) & ~_mask_flag(t).to(device) for t in _checkable(tensors)]
    return torch.stack(flags).any() if flags else torch.zeros((), dtype=torch.bool, device=device)


def _mask_flag(t: torch.Tensor) -> torch.Tensor:
    """`additive_mask` as a 0-dim bool on `t`'s device, not read."""
    return ((t == 0) | (t == float("-inf"))).all()


def wide_norm(tensors: Sequence[torch.Tensor]) -> float:
    """The global L2 norm accumulated in float64, read on the host: finite for any finite
    float32 values (their squares stay below ~1e77), where float32 squares overflow from
    ~1e19. Slower than the float32 norm: for the rare step whose float32 norm overflowed."""
    norms = stacked(_grouped_norms(tensors, 2.0, torch.float64)).tolist() if tensors else []
    return math.sqrt(math.fsum(n * n for n in norms))


def nonfinite(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """True (a 0-dim bool on `device`) when any element of `tensors` is NaN or inf.

    Exact, unlike a norm or a sum, which finite values can overflow. NB: the fastest form
    differs by device: on the CPU, each tensor's min and max (NaN propagates into both);
    on CUDA, one fused float64 L1 norm per dtype group instead of a kernel per tensor.
    """
    tensors = _checkable(tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.bool, device=device)
    if device.type == "cpu":
        values = stacked(extremes(tensors))
        # NB: x - x is NaN exactly when x is NaN or inf: three small kernels where
        # isfinite, all and a negation take five
        return torch.isnan(values - values).any()
    sums = _grouped_norms(tensors, 1.0, torch.float64)
    return ~torch.isfinite(torch.stack([s.to(device) for s in sums])).all()


def extremes(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's min and max (0-dim, in its dtype): all of them are finite exactly
    when every element is (a NaN propagates into both). The CPU's cheapest exact check:
    one kernel per tensor, judged wherever the values are read."""
    return [v for t in _checkable(tensors) for v in torch.aminmax(_real(t))]


def _checkable(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors with values to check, as strided real tensors of this rank."""
    out = []
    for t in tensors:
        if (t.is_floating_point() or t.is_complex()) and t.numel() and not t.is_meta:
            t = _values(t)
            if t.numel():
                out.append(t)
    return out


def stacked(values: list[torch.Tensor]) -> torch.Tensor:
    """One-element tensors (flags, losses, norms) as one 1-D tensor, to read in one go,
    widened to float64 when their dtypes differ (a flag among numbers reads 0.0 or 1.0;
    flags alone stay bool)."""
    values = [v if v.dim() == 0 else v.reshape(()) for v in values]
    if len({v.dtype for v in values}) > 1:
        values = [v.double() for v in values]  # NB: widening keeps inf and NaN
    return torch.stack(values)


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


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a DTensor: FSDP's parameters, gradients and
    optimizer state), the tensor itself otherwise: the checks here never cross ranks."""
    if type(t) is torch.Tensor:  # NB: the common case, without a failed attribute lookup
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's value over all ranks (a DTensor's `full_tensor()`: a collective,
    so every rank must call it at the same point), the tensor itself otherwise."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def _real(t: torch.Tensor) -> torch.Tensor:
    return t.abs() if t.is_complex() else t.reshape(-1) if t.dim() == 0 else t
