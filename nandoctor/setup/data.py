"""The stream of batches a replay steps through, numbered by optimizer step.

Epochs cycle until the run has its steps: a list or a DataLoader is iterated again; a
one-shot iterator (a generator) is rebuilt by calling the user's data callable again.

NB: the stream draws its randomness (a DataLoader's shuffle, a generator's torch.rand)
from a generator of its own, seeded from the run's seed, never from the global one that
dropout and initialisation use. So the batches are the same whatever the model does with
the global RNG: a float16 and a bfloat16 run see identical batches in identical order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from nandoctor.errors import ConfigError, kind_of, user_code


@dataclass(frozen=True)
class MicroBatches:
    """The batches of one optimizer step under gradient accumulation (`grad_accum_steps`):
    batch i of the stream is micro-batch i % N of step i // N."""

    batches: tuple[Any, ...]


class BatchStream:
    """Yields `(step, batch)` from `start_step`, cycling epochs of the user's data; with
    `accum` > 1, each step's batch is a `MicroBatches` of `accum` consecutive batches."""

    def __init__(
        self,
        make: Callable[[], Iterable[Any]],
        seed: int,
        start_step: int = 0,
        accum: int = 1,
        where: str = "data",
    ):
        self._make = make
        self._where = where  # NB: what an error names: `data (train.py:build_data)`
        self._start_step = start_step
        self._accum = accum
        self._torch_state = torch.Generator().manual_seed(seed).get_state()
        self._py_state = random.Random(seed).getstate()
        self._first: Iterable[Any] | None = None

    def first_epoch(self) -> Iterable[Any]:
        """The user's data, built once (with the stream's own RNG) and kept for epoch 1."""
        if self._first is None:
            self._first = self._private_rng(lambda: self._call_make())
            if not _is_iterable(self._first):
                what = kind_of(self._first)
                raise ConfigError(f"data: returned {what}, expected an iterable of batches")
            refuse_a_dataset_of_samples(self._first)
        return self._first

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        if self._accum == 1:
            yield from enumerate(self._batches(), self._start_step)
            return
        group: list[Any] = []
        for index, batch in enumerate(self._batches()):
            group.append(batch)
            if len(group) == self._accum:
                yield self._start_step + index // self._accum, MicroBatches(tuple(group))
                group = []

    def _batches(self) -> Iterator[Any]:
        """Every batch of every epoch, in order."""
        epoch = 0
        while True:
            source = self.first_epoch() if epoch == 0 else self._epoch_source()
            _set_epoch(source, epoch)
            iterator = self._private_rng(lambda: iter(source))  # noqa: B023
            empty = True
            while True:
                batch = self._private_rng(lambda: next(iterator, _END))  # noqa: B023
                if batch is _END:
                    break
                empty = False
                yield batch
            if empty:
                which = "the first epoch" if epoch == 0 else f"epoch {epoch + 1}"
                raise ConfigError(f"data: yielded no batches in {which}")
            epoch += 1

    def _epoch_source(self) -> Iterable[Any]:
        first = self.first_epoch()
        # A one-shot iterator (a generator) is spent after an epoch: build a fresh one.
        return self._private_rng(self._call_make) if isinstance(first, Iterator) else first

    def _call_make(self) -> Iterable[Any]:
        with user_code(self._where):
            return self._make()

    def _private_rng(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` with the stream's RNG state swapped into torch's and Python's globals."""
        torch_saved, py_saved = torch.get_rng_state(), random.getstate()
        torch.set_rng_state(self._torch_state)
        random.setstate(self._py_state)
        try:
            with user_code(self._where):
                return fn()
        finally:
            self._torch_state, self._py_state = torch.get_rng_state(), random.getstate()
            torch.set_rng_state(torch_saved)
            random.setstate(py_saved)


_END = object()


def _set_epoch(source: Any, epoch: int) -> None:
    """A DistributedSampler shuffles by its epoch: set it, as the job's loop does."""
    sampler = getattr(source, "sampler", None)
    if isinstance(sampler, torch.utils.data.DistributedSampler):
        sampler.set_epoch(epoch)


# NB: the modules, not the package: a user's own folder may well be called `datasets`
_HF_DATASET_MODULES = (
    "datasets.arrow_dataset",
    "datasets.iterable_dataset",
    "datasets.dataset_dict",
)


def refuse_a_dataset_of_samples(data: Any) -> None:
    """A map-style dataset iterates one sample at a time (by index, until IndexError), not
    one batch: stepped as it is, every step would train on a single unbatched sample, or the
    loss would raise on its shape and seem to be at fault. The DataLoader the user's loop
    wraps it in is what makes the batches. Likewise a Hugging Face `datasets` dataset
    (map-style or iterable), whose items are examples."""
    kind = type(data)
    from_datasets = kind.__module__ in _HF_DATASET_MODULES
    map_style = isinstance(data, torch.utils.data.Dataset) and not isinstance(
        data, torch.utils.data.IterableDataset
    )
    if map_style or from_datasets:
        raise ConfigError(
            f"data: returned a {kind.__name__}, a dataset of samples; expected batches",
            hint="return torch.utils.data.DataLoader(dataset, batch_size=...), as your loop "
            "iterates it (a dataset whose items are already batches: batch_size=None)",
        )


def _is_iterable(obj: Any) -> bool:
    try:
        iter(obj)
    except TypeError:
        return False
    return True
