"""Which batches each rank of a data-parallel replay sees: the ones it sees in the job.

A data callable is sharded by nandoctor only when it gives every rank the same data;
data that is already rank-aware is left as it is, or rank 1 would see its own batches
1, 3, 5, ... and the failure would land at another step. How it was split is reported
as `environment.data_sharding`:

    self          the data shards itself: a callable taking `rank` and `world_size`, or
                  one whose first batch differs between ranks (it reads its rank from
                  torch.distributed)
    sampler       a map-style DataLoader, through a DistributedSampler: the user's own,
                  kept, or one nandoctor adds to a loader that is the same on every rank
    by-position   the same iterable on every rank: batch i goes to rank i % world_size
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from nandoctor.setup.data import refuse_a_dataset_of_samples, untouched

Gather = Callable[[Any], list[Any]]


def fingerprint(batch: Any) -> str:
    """A digest of a batch's structure and values (tensors by their bytes)."""
    digest = hashlib.sha256()
    for part in _parts(batch):
        digest.update(part)
    return digest.hexdigest()


def _parts(obj: Any) -> Iterator[bytes]:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        yield f"{t.dtype}{list(t.shape)}".encode()
        yield t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    elif isinstance(obj, Mapping):
        for key in obj:
            yield repr(key).encode()
            yield from _parts(obj[key])
    elif isinstance(obj, (list, tuple)):
        yield f"{type(obj).__name__}{len(obj)}".encode()
        for item in obj:
            yield from _parts(item)
    else:
        yield repr(obj).encode()


class Sharder:
    """Splits a rank's data the way its job does; decides once, on the first epoch."""

    def __init__(self, rank: int, world_size: int, gather: Gather) -> None:
        self.rank, self.world_size, self.gather = rank, world_size, gather
        self.how: str | None = None

    def split(self, data: Any) -> Iterable[Any]:
        refuse_a_dataset_of_samples(data)  # NB: before its samples are dealt out as batches
        if isinstance(data, DataLoader) and isinstance(data.sampler, DistributedSampler):
            self.how = "sampler"  # the user's own: the job's own split
            return data
        if self.how is None:
            data, same = self._same_on_every_rank(data)
            self.how = ("sampler" if _map_style(data) else "by-position") if same else "self"
        if self.how == "self":
            return data
        if self.how == "sampler" and _map_style(data):
            return self._with_sampler(data)
        return _EveryNth(data, self.rank, self.world_size)

    def _same_on_every_rank(self, data: Any) -> tuple[Any, bool]:
        """Compare the first batch's fingerprint across ranks, without spending it (a
        one-shot iterator gets it back in front; what the look drew from the global RNG
        and from a loader's own generator is put back: the job's loop never looked)."""
        if isinstance(data, Iterator):
            first = next(data, None)
            data = itertools.chain([] if first is None else [first], data)
        else:
            with untouched(data):
                first = next(iter(data), None)
        prints = self.gather(fingerprint(first))
        return data, len(set(prints)) == 1

    def _with_sampler(self, data: DataLoader) -> DataLoader:
        sampler: DistributedSampler = DistributedSampler(
            data.dataset,
            num_replicas=self.world_size,
            rank=self.rank,
            shuffle=isinstance(data.sampler, RandomSampler),
        )
        return DataLoader(
            data.dataset,
            batch_size=data.batch_size,
            sampler=sampler,
            num_workers=data.num_workers,
            collate_fn=data.collate_fn,
            pin_memory=data.pin_memory,
            drop_last=data.drop_last,
        )


def _map_style(data: Any) -> bool:
    return (
        isinstance(data, DataLoader)
        and hasattr(data.dataset, "__getitem__")
        and bool(data.batch_size)
    )


class _EveryNth:
    """Batch i goes to rank i % world_size; re-iterable when the data is."""

    def __init__(self, data: Iterable[Any], rank: int, world_size: int) -> None:
        self.data, self.rank, self.world_size = data, rank, world_size

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.data), self.rank, None, self.world_size)


__all__ = ["Sharder", "fingerprint"]
