"""Sharded data parallelism: FSDP2's `fully_shard`, applied the way users apply it.

Each rank builds the model with the same seed, then `fully_shard` goes on each child module
that holds parameters (or on the modules `distributed.shard_modules` names: the transformer
blocks, say; a `ModuleList` stands for its modules), deepest first, and last on the root.
The optimizer is built afterwards, on the sharded parameters (DTensors), so each rank steps
its own shard.

The origin rule is DDP's: a rank whose own gradients went non-finite *before* they were
combined is an origin. FSDP2 combines them with one reduce-scatter per sharded module, and
lets a module use a custom reduce-scatter (`set_custom_reduce_scatter`); ours looks at the
input (this rank's full, unsharded local gradients) on the device, then does what the
default does. The flag joins the sentinel's one all-reduce per step (`Ranks`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from nandoctor.errors import ConfigError
from nandoctor.setup.distributed import Ranks
from nandoctor.setup.dtypes import torch_dtype
from nandoctor.setup.schema import DistributedConfig, FsdpMixedPrecision

NEEDS = "distributed.strategy: fsdp needs PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard"


def shard(model: nn.Module, config: DistributedConfig, ranks: Ranks) -> nn.Module:
    """`fully_shard` the chosen modules, then the root, in place; the model it returns is
    the one to build the optimizer on (its parameters are now this rank's shards)."""
    api = _fsdp_api()
    policy = _policy(api, config.mixed_precision)
    for module in _targets(model, config.shard_modules):
        api.fully_shard(module, mp_policy=policy)
    api.fully_shard(model, mp_policy=policy)
    comm = _checked_reduce_scatter(api, ranks)
    for module in model.modules():
        if isinstance(module, api.FSDPModule):
            cast(Any, module).set_custom_reduce_scatter(comm)
    ranks.sharded = True
    return model


def shard_optimizer_state(
    optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> dict[str, Any]:
    """A checkpoint's optimizer state (whole tensors, as one process saved them) cut into
    this rank's shards: each tensor shaped like its (sharded) parameter becomes a DTensor
    placed like it; the rest (Adam's `step`) is kept whole. Every rank reads the same file,
    so each cuts its own shard (no collective)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]

    def cut(p: torch.Tensor, value: Any) -> Any:
        whole = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape
        if not (isinstance(p, DTensor) and whole):
            return value
        mesh, placements = p.device_mesh, p.placements
        return distribute_tensor(value.to(p.device), mesh, placements, src_data_rank=None)

    state = {
        i: {k: cut(params[i], v) for k, v in s.items()} if _index(i, params) else s
        for i, s in saved.get("state", {}).items()
    }
    return {**saved, "state": state}


def _index(i: Any, params: list[torch.Tensor]) -> bool:
    return isinstance(i, int) and 0 <= i < len(params)


class _Api:
    """The few FSDP2 names nandoctor uses, found once (a torch without them is refused)."""

    def __init__(self) -> None:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        self.fully_shard: Any = fully_shard
        self.FSDPModule: type = FSDPModule
        self.MixedPrecisionPolicy: Any = MixedPrecisionPolicy
        self.ReduceScatter: type = ReduceScatter


def _fsdp_api() -> _Api:
    try:
        api = _Api()
    except ImportError:
        raise ConfigError(
            f"{NEEDS}), which torch {torch.__version__} does not have",
            hint="upgrade torch, or use strategy: ddp",
        ) from None
    if not hasattr(api.FSDPModule, "set_custom_reduce_scatter"):
        raise ConfigError(
            f"{NEEDS} with set_custom_reduce_scatter), which torch {torch.__version__} "
            "does not have",
            hint="upgrade torch, or use strategy: ddp",
        )
    return api


def _policy(api: _Api, mixed: FsdpMixedPrecision | None) -> Any:
    if mixed is None:
        return api.MixedPrecisionPolicy()
    return api.MixedPrecisionPolicy(
        param_dtype=torch_dtype(mixed.param_dtype) if mixed.param_dtype else None,
        reduce_dtype=torch_dtype(mixed.reduce_dtype) if mixed.reduce_dtype else None,
    )


def _targets(model: nn.Module, names: Sequence[str] | None) -> list[nn.Module]:
    """The modules to shard before the root, deepest first (`fully_shard` goes bottom-up)."""
    if not _holds_parameters(model):
        raise ConfigError("distributed.strategy: fsdp: the model has no parameters to shard")
    if names is None:
        return [m for child in model.children() for m in _shardable(child)]
    by_path = dict(model.named_modules())
    depth = {id(m): p.count(".") for p, m in by_path.items()}
    chosen: dict[int, nn.Module] = {}  # NB: by id: a module shared by two paths
    for name in names:
        found = {p: m for p, m in by_path.items() if p == name or type(m).__name__ == name}
        if not found:
            raise ConfigError(
                f"distributed.shard_modules: no module of the model is named or typed "
                f"'{name}'{_suggest(name, by_path)}"
            )
        empty = [p for p, m in found.items() if not _holds_parameters(m)]
        if empty:
            where = f" ({empty[0]})" if empty[0] else " (the model itself)"
            raise ConfigError(
                f"distributed.shard_modules: '{name}'{where} holds no parameters to shard"
            )
        for path, module in found.items():
            if path:  # NB: the root (named by its class) is sharded last anyway
                chosen.update({id(m): m for m in _shardable(module)})
    return sorted(chosen.values(), key=lambda m: -depth[id(m)])  # NB: deepest first


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _shardable(module: nn.Module) -> list[nn.Module]:
    """`module`, or for a container that has no forward of its own (`nn.ModuleList`,
    `nn.ModuleDict`: `fully_shard` refuses them) the modules it holds, as users shard a
    transformer's `layers` one block at a time. NB: parameters a container holds itself
    (`nn.ParameterList`) stay with the root's shard."""
    if not _holds_parameters(module):
        return []
    if type(module).forward is not nn.Module.forward:
        return [module]
    return [m for child in module.children() for m in _shardable(child)]


def _suggest(name: str, by_path: dict[str, nn.Module]) -> str:
    known = [p for p in by_path if p] + sorted({type(m).__name__ for m in by_path.values()})
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _checked_reduce_scatter(api: _Api, ranks: Ranks) -> Any:
    """A reduce-scatter that first notes whether this rank's own gradients are finite."""

    class CheckedReduceScatter(api.ReduceScatter):  # type: ignore[name-defined]
        def allocate(
            self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device
        ) -> torch.Tensor:
            # NB: zeros, not empty: the padding of uneven shards must never read as a NaN
            return torch.zeros(*size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: dist.ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> Any:
            ranks.note_local_gradients(input_tensor)
            return dist.reduce_scatter_single(
                output_tensor, input_tensor, group=group, op=op, async_op=async_op
            )

    return CheckedReduceScatter()


__all__ = ["shard"]
