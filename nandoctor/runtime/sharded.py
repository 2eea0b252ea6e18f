"""Snapshots of sharded state (FSDP): each rank keeps its own shard, and gets it back.

FSDP's parameters and the optimizer's state beside them are DTensors: each rank holds a
shard of each. A snapshot keeps only that shard (`to_local`, the same bytes the rank
already holds, never a gather), and a restore wraps the kept shards back into DTensors
placed like the live ones, which `load_state_dict` copies in place. Every rank restores
its own shard, so the replay of a bad step runs on all ranks in lockstep from the same
step, as for DDP. Unsharded state passes through both ways untouched.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from nandoctor.runtime.tensors import local


def local_state(state: dict[str, Any]) -> dict[str, Any]:
    """A model's state_dict with each DTensor replaced by this rank's shard."""
    return {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def local_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's state_dict with each DTensor of its per-parameter state replaced by
    this rank's shard (the param_groups are left as they are)."""
    per_param = {i: local_state(s) for i, s in state["state"].items()}
    return {**state, "state": per_param}


def model_state_like(model: nn.Module, kept: dict[str, Any]) -> dict[str, Any]:
    """`kept` (shards, from `local_state`) with each entry the live state holds as a DTensor
    wrapped back into one, placed like it: what `model.load_state_dict` accepts."""
    live = model.state_dict()
    return {k: _like(live.get(k), v) for k, v in kept.items()}


def optimizer_state_like(optimizer: torch.optim.Optimizer, kept: dict[str, Any]) -> dict[str, Any]:
    """`kept` (from `local_optimizer_state`) with each per-parameter tensor shaped like its
    parameter's shard wrapped back into a DTensor placed like the parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = {
        i: {k: _like(params[i], v) if _shard_of(params[i], v) else v for k, v in s.items()}
        for i, s in kept["state"].items()
    }
    return {**kept, "state": per_param}


def class_name(module: nn.Module) -> str:
    """The module's own class name: `fully_shard` swaps a module's class for a subclass
    named `FSDP<Name>` (bases: FSDPModule, the user's class), which a report never shows."""
    cls = type(module)
    bases = [b for b in cls.__bases__ if b.__name__ != "FSDPModule"]
    if cls.__name__.startswith("FSDP") and len(bases) < len(cls.__bases__) and bases:
        cls = bases[-1]
    return cls.__name__


def _shard_of(param: torch.Tensor, value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() > 0  # NB: Adam's `step` is a 0-dim tensor, never sharded
        and value.shape == local(param).shape
    )


def _like(live: Any, value: Any) -> Any:
    if not (isinstance(live, torch.Tensor) and isinstance(value, torch.Tensor)):
        return value
    if live is local(live):  # not sharded
        return value
    from torch.distributed.tensor import DTensor

    sharded = cast(DTensor, live)  # NB: the one kind of tensor `local` finds a shard of
    return DTensor.from_local(
        value.to(live.device),
        sharded.device_mesh,
        sharded.placements,
        run_check=False,
        shape=live.shape,
        stride=live.stride(),
    )


__all__ = [
    "class_name",
    "local_optimizer_state",
    "local_state",
    "model_state_like",
    "optimizer_state_like",
]
