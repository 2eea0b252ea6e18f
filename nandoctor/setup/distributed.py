"""Data-parallel runs on PyTorch's own distributed engine.

`nandoctor diagnose CONFIG --nproc-per-node N` relaunches itself through
`torch.distributed.run` (torchrun's code, standalone rendezvous on this node); a user's
own `torchrun --nnodes ... -m nandoctor diagnose CONFIG` works the same, rendezvous from
the environment. In each worker, `join` starts the process group, the model is wrapped in
DistributedDataParallel (or sharded with FSDP2's `fully_shard`: `setup.fsdp`), and each
rank gets its shard of the data.

The sentinel's flags cross ranks once per step, in one small all-reduce of a
`world_size x slots` tensor (each rank fills its row), so every rank stops at the same
step and knows which ranks went non-finite **before** the gradient all-reduce (their
batch, forward, loss or local gradients, seen by a DDP communication hook or by FSDP's
reduce-scatter) and which only got it **through** the all-reduce (or reduce-scatter).
"""

from __future__ import annotations

import datetime
import inspect
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nandoctor.errors import ConfigError
from nandoctor.setup.devices import resolve_device
from nandoctor.setup.schema import DistributedConfig
from nandoctor.setup.sharding import Sharder


def under_launcher() -> bool:
    """True inside a worker started by torchrun / torch.distributed.run."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def current_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Ranks:
    """This process's place in the job, and the per-step exchange of sentinel flags."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: torch.device) -> None:
        self.rank, self.world_size, self.local_rank, self.device = (
            rank,
            world_size,
            local_rank,
            device,
        )
        self._local_bad = torch.zeros((), dtype=torch.bool, device=device)
        self._noted = False  # gradients were seen before they were combined, this step
        self.sharded = False  # FSDP (`setup.fsdp`): each rank holds a shard of each parameter
        self.data_sharding: str | None = None  # self | sampler | by-position, once sharded

    def wrap(self, model: torch.nn.Module) -> DistributedDataParallel:
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids)
        ddp.register_comm_hook(self, _check_then_allreduce)
        return ddp

    def note_local_gradients(self, bucket_values: torch.Tensor) -> None:
        """Called with this rank's own gradients just before they are combined: a DDP
        bucket before its all-reduce, an FSDP module's before its reduce-scatter."""
        self._local_bad = self._local_bad | ~torch.isfinite(bucket_values).all()
        self._noted = True

    def local_grads_bad(self) -> torch.Tensor | None:
        """Whether this rank's own gradients held NaN/inf before the all-reduce; resets.
        None when none were seen (FSDP on one rank combines nothing): then the gradients'
        own check is the local one."""
        flag, self._local_bad = self._local_bad, torch.zeros_like(self._local_bad)
        noted, self._noted = self._noted, False
        return flag if noted else None

    def gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        table = torch.zeros((self.world_size, row.numel()), dtype=row.dtype, device=row.device)
        table[self.rank] = row
        dist.all_reduce(table)
        return table

    def largest(self, value: int) -> int:
        """The largest of every rank's `value` (every rank must call it, at the same point)."""
        out = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX)
        return int(out.item())

    def leave(self) -> None:
        leave()

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def shard(
        self, make: Callable[..., Any], kwargs: dict[str, Any]
    ) -> Callable[[], Iterable[Any]]:
        """The user's data callable, as this rank sees it in the job: by its own `rank` and
        `world_size` parameters when it has them, else as `setup.sharding` decides (the
        data is split only when it is the same on every rank)."""
        if _accepts(make, "rank", "world_size"):
            self.data_sharding = "self"
            return lambda: make(**kwargs, rank=self.rank, world_size=self.world_size)
        sharder = Sharder(self.rank, self.world_size, self.gather_objects)

        def build() -> Iterable[Any]:
            data = sharder.split(make(**kwargs))
            self.data_sharding = sharder.how
            return data

        return build


# The job's store key where the first rank that fails says why (`announce_failure`)
FAILED_KEY = "nandoctor/failed"
_job_store: Any = None  # the job's store, kept from `join` (it outlives the process group)


def announce_failure(message: str) -> bool:
    """A rank that fails (another rank hung, its own error) says why in the job's store
    before it exits: the launcher then stops the other ranks with SIGTERM, and rank 0,
    which would take that for an interrupt (a cancelled job), reads it there instead
    (`failed_peer`). True when another rank had already said the same (a config error
    every rank meets: one line for the job is enough). NB: best effort: a job without a
    store (or one already gone) has nothing to tell."""
    store = _job_store
    if store is None:
        return False
    try:
        # NB: atomic: the first rank's message stays, and each rank learns what it is
        told = store.compare_set(FAILED_KEY, "", message).decode("utf-8", errors="replace")
    except Exception:
        return False
    return told != message and _RANK_PREFIX.sub("", told) == _RANK_PREFIX.sub("", message)


_RANK_PREFIX = re.compile(r"^rank \d+: ")


def failed_peer() -> str | None:
    """Why another rank failed, when one did (`announce_failure`); None otherwise."""
    store = _job_store
    try:
        if store is None or not store.check([FAILED_KEY]):
            return None
        return store.get(FAILED_KEY).decode("utf-8", errors="replace")
    except Exception:
        return None


def leave() -> None:
    """Wait for every rank, then close the process group: a process that exits while
    gloo's threads still run is aborted ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _check_then_allreduce(state, bucket):
    # NB: no annotations: DDP compares them with dist.GradBucket, and ours are strings
    state.note_local_gradients(bucket.buffer())
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group


def join(config: DistributedConfig, device_name: str) -> Ranks | None:
    """Start the process group when launched by torchrun; None for a single process."""
    if not under_launcher():
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = check_backend(config, device_name)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = config.backend or ("nccl" if cuda else "gloo")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=config.timeout_s)
        dist.init_process_group(backend, timeout=timeout)
    _keep_store()
    return Ranks(rank, world, local, device)


def check_backend(config: DistributedConfig, device_name: str) -> bool:
    """Whether the ranks run on CUDA; a backend that cannot run where they do is a config
    error. NB: asked before nandoctor launches the ranks too, so that the job says it
    once (each rank meets it before any store could tell it another rank said it)."""
    if device_name != "auto":
        device = resolve_device(device_name)  # NB: CUDA asked for where there is none
        if device.type == "cuda" and device.index is not None:
            raise ConfigError(
                f"device: '{device_name}' in a distributed run: each rank runs on "
                "cuda:<its local rank>; write device: cuda (or restrict the visible devices "
                "with CUDA_VISIBLE_DEVICES)"
            )
    cuda = torch.cuda.is_available() and device_name != "cpu"
    if config.backend == "nccl" and not cuda:
        raise ConfigError("distributed.backend: nccl needs CUDA devices; use gloo on the CPU")
    return cuda


def _keep_store() -> None:
    """Keep the job's store (torchrun's, shared by every rank) past the process group: an
    interrupted rank destroys its group, then still reads why (`failed_peer`)."""
    global _job_store
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        _job_store = _get_default_store()
    except Exception:  # NB: a private torch function: without it, nothing is told
        _job_store = None


def _accepts(fn: Callable[..., Any], *names: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


def launch(argv: list[str], nproc_per_node: int) -> dict[int, int]:
    """Run `python -m nandoctor ARGV` on `nproc_per_node` workers through torchrun's code;
    the exit code of each rank that did not exit 0 (none: every rank did). The CLI makes
    the job's exit code of them (`cli.outcome.of_ranks`)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # NB: a rank that found a NaN exits 1 on purpose; the launcher need not log it as an error
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, torch.get_num_threads() // nproc_per_node)))

    # NB: torchrun's own log folder (torchelastic_*, with each rank's error file) would be
    # made in the temporary directory and left there; ours goes on every ending but SIGKILL
    with tempfile.TemporaryDirectory(prefix="nandoctor-ranks-") as logs:
        args = get_args_parser().parse_args(
            [
                "--standalone",
                f"--nproc-per-node={nproc_per_node}",
                "--max-restarts=0",
                f"--log-dir={logs}",
                "-m",
                "nandoctor",
                *argv,
            ]
        )
        try:
            run(args)
        except ChildFailedError as e:
            return {rank: f.exitcode for rank, f in e.failures.items()}
    return {}


__all__ = [
    "Ranks",
    "announce_failure",
    "current_rank",
    "failed_peer",
    "join",
    "launch",
    "leave",
    "under_launcher",
]
