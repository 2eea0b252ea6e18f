"""What the tracer needs to know about one operator call: its tensors by argument name,
which arguments it writes, whether it is a view or leaves memory unwritten, and its
float32 twin. Where it was issued is frames.py's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from nandoctor.report.evidence import Recompute
from nandoctor.runtime.tensors import local

_REDUCED = (torch.float16, torch.bfloat16)


def op_name(func: Any) -> str:
    """`aten.log.default`, as SPEC.md spells operators."""
    return str(func)


def named_tensors(func: Any, args: tuple, kwargs: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor argument with its schema name; list arguments as `name[i]`."""
    names = [a.name for a in func._schema.arguments]
    pairs = [*zip(names, args, strict=False), *kwargs.items()]
    for name, value in pairs:
        if isinstance(value, torch.Tensor):
            yield name, local(value)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if isinstance(v, torch.Tensor):
                    yield f"{name}[{i}]", local(v)


# NB: these allocate and leave the memory as it was: whatever they "hold" is garbage
_UNWRITTEN = frozenset(
    {
        "empty",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "empty_strided",
        "empty_permuted",
        "resize_",
        "resize_as_",
        "_empty_affine_quantized",
        "_empty_per_channel_affine_quantized",
    }
)
# NB: in-place ops that write every element of `self` whatever it held before
_OVERWRITES = frozenset(
    {"copy_", "fill_", "zero_", "bernoulli_", "uniform_", "normal_", "random_", "exponential_"}
)


# NB: ops that write only this rank's part of a buffer a collective then fills (FSDP2's
# copy of the local shards into its all-gather buffer): the rest is whatever the memory
# held before, often another step's NaN, until the all-gather lands
_PARTLY_WRITTEN = frozenset({("fsdp", "all_gather_copy_in")})


def leaves_unwritten(func: Any) -> bool:
    """An op whose output is memory no one wrote yet (or not all of it): not a value,
    never checked."""
    space, name = func.namespace, func.overloadpacket.__name__
    return (space == "aten" and name in _UNWRITTEN) or (space, name) in _PARTLY_WRITTEN


# NB: ops that sum products of their inputs' elements: an additive mask's -inf never goes
# through one on purpose (a softmax or a fill removes it first), so a batch tensor of only
# 0 and -inf that meets one is data (`log` of a 0/1 feature), not a mask
_CONTRACTIONS = frozenset(
    {
        "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv",
        "dot", "vdot", "einsum", "tensordot", "_addmm_activation", "convolution",
        "_convolution", "conv1d", "conv2d", "conv3d",
    }
)  # fmt: skip


def multiplies(func: Any, name: str) -> bool:
    """Argument `name` is a factor of a matrix product or a convolution (`mat1` of
    `addmm`), not a term added to it (`self` of `addmm` and `baddbmm`, a `bias`)."""
    if func.namespace != "aten" or (op := func.overloadpacket.__name__) not in _CONTRACTIONS:
        return False
    arg = name.split("[")[0]
    added = arg == "bias" or (arg == "self" and op.lstrip("_").startswith(("add", "badd")))
    return not added


def is_collective(func: Any) -> bool:
    """A c10d collective (`_reduce_scatter_base_`, `allreduce_`): what it writes comes from
    every rank, and may arrive after it returned (work in flight)."""
    return func.namespace == "c10d"


def collective_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors a collective returns (its outputs: c10d's schemas do not mark them as
    written), nested lists flattened; its `Work` left out."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for part in out for t in collective_outputs(part)]
    return []


def is_view(func: Any) -> bool:
    """An op whose output shows its input's values (`view`, `t`, `expand`, `detach`)."""
    return bool(getattr(func, "is_view", False))


def overwrites(func: Any, name: str) -> bool:
    """True when the op writes all of argument `name` without reading it first."""
    return name.startswith("out") or (
        name == "self" and func.overloadpacket.__name__ in _OVERWRITES
    )


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """The arguments an in-place or out= op writes into (a parameter in `add_`)."""
    if not func._schema.is_mutable:
        return []
    writes = {
        a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write
    }
    return [(n, t) for n, t in named_tensors(func, args, kwargs) if n.split("[")[0] in writes]


def output_tensors(out: Any, *, shards: bool = True) -> list[torch.Tensor]:
    """An op's tensor outputs; with `shards`, a sharded one (a DTensor: FSDP's optimizer
    step) as this rank's shard, which is what the checks read and the lineages follow."""
    tensors = [out] if isinstance(out, torch.Tensor) else out
    if not isinstance(tensors, (list, tuple)):
        return []
    return [local(t) if shards else t for t in tensors if isinstance(t, torch.Tensor)]


def scalar_nonfinite(args: tuple, kwargs: dict) -> tuple[bool, bool]:
    """(NaN, inf) among plain-number arguments: `masked_fill(mask, -inf)` means it."""
    values = [v for v in _flat([*args, *kwargs.values()]) if isinstance(v, float)]
    return any(math.isnan(v) for v in values), any(math.isinf(v) for v in values)


def scalars_text(func: Any, args: tuple, kwargs: dict) -> list[str]:
    names = [a.name for a in func._schema.arguments]
    pairs = [*zip(names, args, strict=False), *kwargs.items()]
    return [
        f"{n}={v!r}"
        for n, v in pairs
        if isinstance(v, (int, float, bool)) and not isinstance(v, torch.Tensor)
    ]


def _flat(values: list) -> Iterator[Any]:
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from _flat(list(v))
        else:
            yield v


def recompute_float32(func: Any, args: tuple, kwargs: dict, index: int = 0) -> Recompute | None:
    """Run the op again with its reduced-precision inputs upcast to float32.

    Finite there: a precision problem (overflow, underflow). Still non-finite: the math
    itself (log of zero, 0/0, a domain error). In-place ops are not rerun: their input
    is gone. Nor are collectives: the other ranks would never join a second one. Nor are
    random ops (dropout, bernoulli): a rerun draws other numbers than the run did, and
    moves the generator, so every later random op of the replay would differ from the run.
    """
    if func._schema.is_mutable or is_collective(func) or _RANDOM in func.tags:
        return None
    try:
        up_args = tuple(_upcast(a) for a in args)
        up_kwargs = {k: _upcast(v) for k, v in kwargs.items()}
        if up_kwargs.get("dtype") in _REDUCED:
            up_kwargs["dtype"] = torch.float32
        outs = [t for t in output_tensors(func(*up_args, **up_kwargs)) if t.is_floating_point()]
    except Exception as e:  # an op without a float32 kernel for these arguments
        return Recompute("float32", finite=False, absmax=None, error=f"{type(e).__name__}: {e}")
    if not outs:
        return None
    out = outs[min(index, len(outs) - 1)]
    finite = bool(torch.isfinite(out).all())
    absmax = float(torch.where(torch.isfinite(out), out.abs(), 0).max()) if out.numel() else 0.0
    return Recompute("float32", finite=finite, absmax=absmax)


_RANDOM = torch.Tag.nondeterministic_seeded


def _upcast(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        v = value.detach()
        return v.float() if v.dtype in _REDUCED else v.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(v) for v in value)
    return value
