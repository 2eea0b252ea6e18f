"""The stream of batches a replay steps through, numbered by optimizer step.

It draws the batches as the user's own loop does (docs/config.md, "Data and steps")::

    seed(seed); model = build_model(); data = build_data()
    for epoch in itertools.count():
        sampler.set_epoch(epoch)          # a DistributedSampler's, as a job's loop does
        for batch in data:                # a one-shot iterator: build_data() again
            step(batch)

NB: every draw is the global RNG's (or the loader's own `generator`'s), made when the
user's loop makes it: a DataLoader draws its workers' seed and its shuffle when each
epoch's iteration begins, after the previous epoch's steps (their dropout) drew from the
same RNG, and a dataset's augmentations as each batch is loaded. Nothing iterates the
data ahead of the steps, not even to look at it: a loader's generator draws exactly what
the user's loop draws, so the step a report names is the step in the user's log.

A replay resumed from a snapshot in a fresh session (`resumed`) starts from the
snapshot's kept batch and reaches the stream's place in a sandbox: the epoch under way
begins again from the RNG states it began with (`EpochStart`), its batches drawn so far
are skipped, and the global RNG is put back; later epochs begin live, as the run's did.

For a DataLoader over a map-style dataset the stream also records which dataset indices
each batch holds (`indices_of`), from its batch sampler as the loader draws them (worker
processes or not), without drawing anything more.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from nandoctor.errors import ConfigError, kind_of
from nandoctor.setup.rng import RngState
from nandoctor.setup.user_code import user_code

Indices = tuple[int, ...] | None  # a batch's dataset indices; None: not known
KEPT_INDICES = 256  # steps whose batches' indices are kept (the replays look back less far)


@dataclass(frozen=True)
class MicroBatches:
    """The batches of one optimizer step under gradient accumulation (`grad_accum_steps`):
    batch i of the stream is micro-batch i % N of step i // N."""

    batches: tuple[Any, ...]


@dataclass(frozen=True)
class EpochStart:
    """How an epoch began: the global RNG and the data's own generators (by their place
    on the loader) before its iteration drew from them."""

    epoch: int
    rng: RngState
    generators: tuple[tuple[str, torch.Tensor], ...]


@dataclass(frozen=True)
class Position:
    """Where the stream stood once `step`'s batches were drawn: `offset` batches of
    `epoch` drawn, the epoch begun as `start` says. `batch`: the step's own batch, as the
    snapshot store kept it (a resumed stream yields it first: drawn again, a dataset's
    augmentations would draw from the RNG as the replay left it, not as the run had)."""

    step: int
    epoch: int
    offset: int
    start: EpochStart
    batch: Any = None


class BatchStream:
    """Yields `(step, batch)` from `start_step`, cycling epochs of the user's data; with
    `accum` > 1, each step's batch is a `MicroBatches` of `accum` consecutive batches."""

    def __init__(
        self,
        make: Callable[[], Iterable[Any]],
        start_step: int = 0,
        accum: int = 1,
        where: str = "data",
    ):
        self._make = make
        self._where = where  # NB: what an error names: `data (train.py:build_data)`
        self._start_step = start_step
        self._accum = accum
        self._first: Iterable[Any] | None = None
        self._epoch, self._offset = 0, 0  # where the stream stands: batches of _epoch drawn
        self._start: EpochStart | None = None  # how the epoch under way began
        self._step: int | None = None  # the latest step yielded
        self._log: deque[Any] = deque()  # index lists the batch sampler handed out
        self._indices: OrderedDict[int, tuple[Any, ...]] = OrderedDict()  # as drawn

    def build(self) -> Iterable[Any]:
        """The user's data, built once and kept for the first epoch. A session builds it
        right after the model, where the user's script does: a builder that draws from
        the global RNG (synthetic data) draws what it draws there."""
        if self._first is None:
            self._first = self._call_make()
            if not _is_iterable(self._first):
                what = kind_of(self._first)
                raise ConfigError(f"data: returned {what}, expected an iterable of batches")
            refuse_a_dataset_of_samples(self._first)
        return self._first

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self._steps(self._batches(), self._start_step)

    def resumed(self, position: Position) -> Iterator[tuple[int, Any]]:
        """The steps from `position.step` on, in a session built afresh: that step's kept
        batch, then the batches the run drew after it (the epoch under way reached in a
        sandbox that leaves the global RNG as it finds it)."""
        iterator = self._reach(position)
        self._step = position.step
        yield position.step, position.batch
        batches = self._batches(position.epoch, iterator, position.offset)
        yield from self._steps(batches, position.step + 1)

    def position(self, step: int) -> Position | None:
        """Where the stream stands, if `step` is the step it yielded last (a snapshot taken
        before that step runs: the run resumes from there)."""
        if step != self._step or self._start is None:
            return None
        return Position(step, self._epoch, self._offset, self._start)

    def indices_of(self, step: int) -> tuple[Indices, ...] | None:
        """The dataset indices of each (micro-)batch of `step`, if the stream still knows
        the step; a batch's are None where its data is no map-style DataLoader's."""
        held = self._indices.get(step)
        return None if held is None else tuple(_as_indices(i) for i in held)

    def _steps(self, batches: Iterator[tuple[Any, Any]], first: int) -> Iterator[tuple[int, Any]]:
        group: list[tuple[Any, Any]] = []
        for step in _count(first):
            group.clear()
            for item in batches:
                group.append(item)
                if len(group) == self._accum:
                    break
            self._step = step
            self._indices[step] = tuple(indices for _, indices in group)
            while len(self._indices) > KEPT_INDICES:
                self._indices.popitem(last=False)
            if self._accum == 1:
                yield step, group[0][0]
            else:
                yield step, MicroBatches(tuple(batch for batch, _ in group))

    def _batches(
        self, epoch: int = 0, iterator: Iterator[Any] | None = None, offset: int = 0
    ) -> Iterator[tuple[Any, Any]]:
        """Every batch of every epoch, in order, with its index list; from batch
        `offset` of `epoch`, whose iteration is under way, when `iterator` is given."""
        while True:
            if iterator is None:
                iterator, offset = self._begin(epoch), 0
            self._epoch, self._offset = epoch, offset
            while True:
                with user_code(self._where):
                    batch = next(iterator, _END)
                if batch is _END:
                    break
                offset += 1
                self._offset = offset
                yield batch, self._indices_drawn()
            if offset == 0:
                which = "the first epoch" if epoch == 0 else f"epoch {epoch + 1}"
                raise ConfigError(f"data: yielded no batches in {which}")
            epoch, iterator = epoch + 1, None

    def _begin(self, epoch: int, start: EpochStart | None = None) -> Iterator[Any]:
        """Begin `epoch`'s iteration, as the user's loop does (the RNG draws it makes
        happen now); with `start`, from the states a run's epoch began with."""
        if start is not None:
            start.rng.restore()
        source = self._source(epoch)
        if start is not None:
            _set_generators(source, start.generators)
        else:
            self._start = EpochStart(epoch, RngState.capture(), _generator_states(source))
        _set_epoch(source, epoch)
        self._log.clear()
        with user_code(self._where), _logging_indices(source, self._log):
            return iter(source)

    def _source(self, epoch: int) -> Iterable[Any]:
        first = self.build()
        # NB: a one-shot iterator (a generator) is spent after an epoch: build a fresh one
        return self._call_make() if epoch > 0 and isinstance(first, Iterator) else first

    def _reach(self, position: Position) -> Iterator[Any]:
        """The iteration of `position`'s epoch, begun as the run began it, with the
        batches the run had drawn skipped; the global RNG as it was before."""
        here = RngState.capture()
        try:
            iterator = self._begin(position.epoch, position.start)
            self._start = position.start
            for _ in range(position.offset):
                with user_code(self._where):
                    next(iterator, None)
                self._indices_drawn()
        finally:
            here.restore()
        return iterator

    def _indices_drawn(self) -> Any:
        """The index list of the batch just drawn: the oldest the sampler handed out that
        no batch has claimed (the loader yields batches in that order). NB: kept as the
        sampler made it, read only if asked (`indices_of`): a large batch's thousands of
        indices cost no time a step."""
        return self._log.popleft() if self._log else None

    def _call_make(self) -> Iterable[Any]:
        with user_code(self._where):
            return self._make()


_END = object()


def _count(first: int) -> Iterator[int]:
    step = first
    while True:
        yield step
        step += 1


def _set_epoch(source: Any, epoch: int) -> None:
    """A DistributedSampler shuffles by its epoch: set it, as the job's loop does."""
    if not isinstance(source, DataLoader):
        return
    for sampler in (source.sampler, getattr(source.batch_sampler, "sampler", None)):
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            sampler.set_epoch(epoch)


# -- the loader's own generators -------------------------------------------------------
_GENERATOR_PLACES = (
    "generator",
    "sampler.generator",
    "batch_sampler.generator",
    "batch_sampler.sampler.generator",
)


def _generators(source: Any) -> list[tuple[str, torch.Generator]]:
    """The torch generators a DataLoader draws its shuffle and workers' seeds from, by
    their place on it (each once)."""
    if not isinstance(source, DataLoader):
        return []
    found, seen = [], set()
    for place in _GENERATOR_PLACES:
        obj: Any = source
        for name in place.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, torch.Generator) and id(obj) not in seen:
            seen.add(id(obj))
            found.append((place, obj))
    return found


def _generator_states(source: Any) -> tuple[tuple[str, torch.Tensor], ...]:
    return tuple((place, g.get_state()) for place, g in _generators(source))


def _set_generators(source: Any, states: tuple[tuple[str, torch.Tensor], ...]) -> None:
    held = dict(_generators(source))
    for place, state in states:
        if place in held:
            held[place].set_state(state)


@contextlib.contextmanager
def untouched(data: Any) -> Iterator[None]:
    """The global RNG and the data's own generators as they were, once the block is
    done: a look at the data (its first batch) draws nothing the user's loop would not."""
    rng, states = RngState.capture(), _generator_states(data)
    try:
        yield
    finally:
        rng.restore()
        _set_generators(data, states)


# -- the dataset indices of each batch ---------------------------------------------------
class _LoggedSampler:
    """A DataLoader's batch sampler that notes each index list it hands out (`log`),
    drawing nothing more: its iteration is the sampler's own."""

    def __init__(self, sampler: Any, log: deque[Any]) -> None:
        self._sampler, self._log = sampler, log

    def __iter__(self) -> Iterator[Any]:
        for indices in self._sampler:
            self._log.append(indices)
            yield indices

    def __len__(self) -> int:
        return len(self._sampler)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sampler, name)


@contextlib.contextmanager
def _logging_indices(source: Any, log: deque[Any]) -> Iterator[None]:
    """While the loader's iteration begins (it takes its batch sampler's iterator then,
    and keeps it, across epochs too with persistent workers), let it take a logged one.
    Only a map-style dataset's batches have dataset indices, and only a loader that
    yields batches in the order it sent them out (`in_order`) can be followed."""
    if not (
        isinstance(source, DataLoader)
        and source.batch_sampler is not None
        and not isinstance(source.dataset, IterableDataset)
        and getattr(source, "in_order", True)
    ):
        yield
        return
    real = source.batch_sampler
    if isinstance(real, _LoggedSampler):  # NB: a loader another stream left logged
        real = real._sampler
    # NB: past its construction, a DataLoader refuses a new batch_sampler through setattr
    object.__setattr__(source, "batch_sampler", _LoggedSampler(real, log))
    try:
        yield
    finally:
        object.__setattr__(source, "batch_sampler", real)


def _as_indices(indices: Any) -> Indices:
    if indices is None:
        return None
    try:
        return tuple(int(i) for i in indices)
    except (TypeError, ValueError):  # a sampler of keys, not of positions
        return None


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
    """Whether `iter(obj)` would work, without calling it: beginning a DataLoader's
    iteration draws its workers' seed from its generator (a peek the user's loop never
    makes, which shifts every later shuffle)."""
    kind = type(obj)
    if getattr(kind, "__iter__", None) is not None:
        return True
    return hasattr(kind, "__getitem__")
