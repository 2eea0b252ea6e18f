"""Which samples of the batch the failure began in (SPEC's `first_nonfinite.samples`).

A batch tensor that holds NaN or inf names its rows itself: the rows along the batch's
first dimension that hold them. An op of the forward (or of the loss) that went
non-finite is named by the rows that make it non-finite on their own: the bad step is
run again on subsets of the batch's rows, from the state it began with, and the op is
watched (`_OpWatch`: the same op, in the same module, at the same line). Where the op's
output has the batch's rows first (or a multiple of them: `logits.view(-1, vocab)` of a
`[batch, length, vocab]` tensor), the rows its non-finite values lie in are the
candidates, and two runs confirm them: those rows alone make the op non-finite, the
others alone do not. Otherwise the rows are bisected, in at most `MAX_RUNS` runs.

The list is empty where the rows cannot be told: no row alone makes the op non-finite
(the batch as a whole does: a statistic over it, a mean over no targets), a subset of
the rows does not run (a loss written for one batch size, BatchNorm on one row), the
runs ran out, or the failure began elsewhere (in the backward, the update, the weights).

For a DataLoader over a map-style dataset the batch stream knows each row's dataset index
(`with_indices`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nandoctor.errors import NandoctorError
from nandoctor.localize import ops
from nandoctor.localize.finding import Sighting
from nandoctor.localize.frames import user_source
from nandoctor.localize.modules import ModuleTracker
from nandoctor.localize.stats import batch_rows
from nandoctor.report.types import Sample
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.rerun import KeptStep, StepRunner, named_batch
from nandoctor.runtime.snapshot import StateSnapshot
from nandoctor.runtime.state import TrainingObjects
from nandoctor.runtime.tensors import map_tensors
from nandoctor.setup.data import Indices, MicroBatches

MAX_RUNS = 48  # steps run on subsets of the rows, at most, to find them
SEARCHED = (Phase.FORWARD, Phase.LOSS)  # where an op's rows are looked for by reruns


def find_samples(
    objects: TrainingObjects,
    steps: StepRunner,
    step: int,
    kept: Any,
    finding: Sighting,
    before: StateSnapshot | None,
) -> Sighting:
    """The finding with the rows of `step`'s batch a forward op began in, from reruns from
    `before` (None: no state to rerun from, no search). NB: a batch tensor's rows the
    tracer names as it meets the batch (`held_rows`), whoever drives the step."""
    if finding.phase not in SEARCHED or before is None or in_a_job():
        return finding
    return replace(finding, samples=op_samples(objects, steps, step, kept, finding, before))


def in_a_job() -> bool:
    """A data-parallel job: no reruns on subsets. NB: each rank's step waits for the other
    ranks' in its collectives (DDP's all-reduce), and each rank's search would run its own
    number of steps: the ranks would wait for each other for ever."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def with_indices(finding: Sighting | None, indices: tuple[Indices, ...] | None) -> Sighting | None:
    """The finding, each sample with its dataset index where the stream knows it."""
    if finding is None or not finding.samples or indices is None:
        return finding
    micro = finding.micro_batch or 0
    known = indices[micro] if micro < len(indices) else None
    if known is None or any(s.row >= len(known) for s in finding.samples):
        return finding
    samples = tuple(replace(s, index=known[s.row]) for s in finding.samples)
    return replace(finding, samples=samples)


def micro_batch(kept: Any, micro: int | None) -> Any:
    """The (micro-)batch a finding was born in: a kept step's arguments, a micro-batch."""
    if isinstance(kept, KeptStep):
        return named_batch(*kept.call)  # NB: named as the step's hooks name its batch
    if isinstance(kept, MicroBatches):
        return kept.batches[micro or 0]
    return kept


def op_samples(
    objects: TrainingObjects,
    steps: StepRunner,
    step: int,
    kept: Any,
    finding: Sighting,
    before: StateSnapshot,
) -> tuple[Sample, ...]:
    """The rows that make the origin op non-finite on their own, from reruns of `step`
    on subsets of its batch's rows, each from `before` (the state the step began with)."""
    if finding.phase not in SEARCHED or finding.op is None or finding.root != 0:
        return ()
    size = batch_rows(micro_batch(kept, finding.micro_batch))
    if size is None:
        return ()
    if size == 1:
        return (Sample(0, nonfinite=finding.count),)
    search = _Search(objects, steps, step, kept, finding, before, size)
    try:
        found = search.confirmed(_candidates(finding, size)) or search.bisected()
    except _Unknown:
        return ()
    return tuple(Sample(row, nonfinite=n) for row, n in sorted(found.items()))


def _candidates(finding: Sighting, size: int) -> dict[int, int]:
    """The batch rows the op's non-finite output values lie in, where its first dimension
    is the batch's or a multiple of it (rows flattened with a dimension after them)."""
    first = finding.shape[0] if finding.shape else 0
    if not finding.rows or first == 0 or first % size:
        return {}
    per = first // size
    out: Counter[int] = Counter()
    for row, n in finding.rows:
        out[row // per] += n
    return dict(out)


class _Unknown(Exception):
    """The rows cannot be told (see the module's docstring)."""


class _Search:
    def __init__(
        self,
        objects: TrainingObjects,
        steps: StepRunner,
        step: int,
        kept: Any,
        finding: Sighting,
        before: StateSnapshot,
        size: int,
    ) -> None:
        self.objects, self.steps, self.step, self.kept = objects, steps, step, kept
        self.finding, self.before, self.size = finding, before, size
        self.runs = 0

    def confirmed(self, rows: dict[int, int]) -> dict[int, int] | None:
        """`rows`, if they alone make the op non-finite and the other rows alone do not."""
        if not rows:
            return None
        if len(rows) == self.size:  # NB: every row: each half must make it without the other
            half = self.size // 2
            alone = self.made(list(range(half))) and self.made(list(range(half, self.size)))
            return rows if alone else None
        others = [r for r in range(self.size) if r not in rows]
        if not self.made(sorted(rows)) or self.made(others):
            return None
        return rows

    def bisected(self) -> dict[int, int]:
        return self._narrow(list(range(self.size)))

    def _narrow(self, rows: list[int]) -> dict[int, int]:
        """Each row of `rows` (which together make the op non-finite) that makes it alone,
        with the count it makes."""
        half = len(rows) // 2
        found: dict[int, int] = {}
        for part in (rows[:half], rows[half:]):
            made = self.made(part)
            if made:
                found |= {part[0]: made} if len(part) == 1 else self._narrow(part)
        if not found:  # NB: neither half alone: the rows make it together
            raise _Unknown
        return found

    def made(self, rows: list[int]) -> int:
        """How many non-finite values the op makes in the step run on `rows` only."""
        if self.runs == MAX_RUNS:
            raise _Unknown
        self.runs += 1
        finding = self.finding
        subset = _subset(self.kept, finding.micro_batch, rows, self.size)
        self.before.restore(self.objects)
        watch = _OpWatch(self.objects, finding)
        try:
            with watch:
                self.steps.run(self.step, subset, watch)
        except (NandoctorError, RuntimeError, MemoryError):  # NB: out of memory too
            raise _Unknown from None
        return watch.count


def _subset(kept: Any, micro: int | None, rows: list[int], size: int) -> Any:
    """The step's batch with only `rows` of the (micro-)batch the finding was born in."""
    if isinstance(kept, KeptStep):
        return replace(kept, call=_rows_of(kept.call, rows, size))
    if isinstance(kept, MicroBatches):
        parts = list(kept.batches)
        parts[micro or 0] = _rows_of(parts[micro or 0], rows, size)
        return MicroBatches(tuple(parts))
    return _rows_of(kept, rows, size)


def _rows_of(batch: Any, rows: list[int], size: int) -> Any:
    index = torch.tensor(rows, dtype=torch.long)

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad or t.dim() == 0 or t.shape[0] != size:
            return t  # NB: not the batch's rows (a parameter a kept step holds, a mask)
        return t.index_select(0, index.to(t.device))

    return map_tensors(batch, take)


class _OpWatch(Probe):
    """Counts the non-finite values the finding's op makes in its module, at its line,
    in the finding's (micro-)batch of the forward or the loss."""

    def __init__(self, objects: TrainingObjects, finding: Sighting) -> None:
        assert objects.model is not None
        self.finding = finding
        self.tracker = ModuleTracker(objects.model, enabled=False)
        self.mode = _Dispatch(self._made)
        self.ctx: StepContext | None = None
        self.count = 0

    def __enter__(self) -> _OpWatch:
        self.tracker.__enter__()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)
        self.tracker.__exit__(*exc)

    def step_started(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def step_ended(self, ctx: StepContext) -> None:
        self.ctx = None

    def _made(self, func: Any, out: Any) -> None:
        ctx, finding = self.ctx, self.finding
        if ctx is None or (ctx.micro_batch or 0) != (finding.micro_batch or 0):
            return
        # NB: where the tracer puts an op: a followed loop's ops before its model's
        # forward have no phase of their own, and are the loss's
        if torch._C._current_autograd_node() is not None or ctx.phase not in (*SEARCHED, None):
            return
        if ops.op_name(func) != finding.op or self.tracker.current != finding.module:
            return
        if finding.source is not None and user_source() != finding.source:
            return
        outs = [t for t in ops.output_tensors(out) if t.is_floating_point() or t.is_complex()]
        self.count += sum(int((~torch.isfinite(t)).sum()) for t in outs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, seen: Callable[[Any, Any], None]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen(func, out)
        return out
