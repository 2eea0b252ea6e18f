"""The causal origin: which non-finite value reached the failure, and which ones healed.

Every non-finite tensor the tracer sees carries a `Lineage`: the `Origin` it descends
from, and every origin that flowed into it. An op's non-finite output inherits from its
non-finite inputs; an op that makes a kind of non-finite value none of its inputs held
(NaN from no NaN, inf from no inf) is a new origin. A value that turns finite again
(`where` selects it away, `masked_fill` overwrites it, a softmax sums out a -inf mask, a
cast to integers drops it) carries nothing on: its lineage ends there. When the failure
is reached (a non-finite loss, gradient or weight), its lineage names the origin; the
origins that never reached it are the transients.

Deliberate values: an inf filled in from a scalar (`masked_fill(mask, -inf)`) or a
tensor already non-finite before the step (a mask buffer) is an origin too, marked
`deliberate`. Merged with an accidental one, the accidental origin wins; a NaN made from
deliberate infs only (the softmax of a fully masked row) is a new, accidental origin. A
batch tensor of only 0 and -inf reads as a mask until a matrix product or a convolution
multiplies it into a non-finite output: then it was data (`log` of a 0/1 feature), and
its origin turns accidental (`as_data`).

Cost: one dictionary lookup per input of an op that made a non-finite output. The
tables hold weak references (to tensors, and to their storages for views and saved
tensors), so nothing is kept alive.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.utils.weak import WeakIdKeyDictionary

from nandoctor.localize.finding import Sighting
from nandoctor.report.types import Transient

MAX_TRANSIENTS = 20  # distinct (phase, module, op, line, value) in the report


@dataclass(frozen=True)
class Origin:
    """An op that made a non-finite value none of its inputs held."""

    seq: int  # birth order in the step: the earliest is "first"
    step: int
    finding: Sighting
    deliberate: bool  # filled from a scalar, or a tensor non-finite before the step


@dataclass(frozen=True)
class Lineage:
    """What a non-finite tensor descends from."""

    origin: Origin  # the one reported if this value reaches the failure
    ancestors: frozenset[int]  # seq of every origin that flowed into it


class OriginTable:
    """Lineages of the step's non-finite tensors, and the storages not yet written."""

    def __init__(self) -> None:
        self.born: list[Origin] = []
        self._by_tensor: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # NB: a view, or a tensor autograd saved, is another object on the same storage
        self._by_storage: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._unwritten: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._arriving: WeakIdKeyDictionary = WeakIdKeyDictionary()  # collectives' outputs

    def lineage(self, t: torch.Tensor) -> Lineage | None:
        found = self._by_tensor.get(t)
        if found is None and (storage := _storage(t)) is not None:
            found = self._by_storage.get(storage)
        local = getattr(t, "_local_tensor", None)  # NB: a DTensor (FSDP2) made by from_local
        if found is None and isinstance(local, torch.Tensor):
            found = self.lineage(local)
        return found

    def mark(self, t: torch.Tensor, lineage: Lineage) -> None:
        self._by_tensor[t] = lineage
        if (storage := _storage(t)) is not None:
            self._by_storage[storage] = lineage

    def forget(self, t: torch.Tensor) -> None:
        """An in-place op made `t` finite again."""
        self._by_tensor.pop(t, None)

    def share(self, base: torch.Tensor, views: list[torch.Tensor]) -> None:
        """Views show their base's values: they carry its lineage (unchecked)."""
        found = self._by_tensor.get(base)
        if found is not None:
            for v in views:
                self._by_tensor[v] = found

    def birth(
        self, finding: Sighting, step: int, deliberate: bool, parents: list[Lineage]
    ) -> Lineage:
        origin = Origin(len(self.born), step, finding, deliberate)
        self.born.append(origin)
        return Lineage(origin, _ancestors(parents) | {origin.seq})

    def as_data(self, origin: Origin) -> Origin:
        """`origin`, deliberate until now, was accidental after all (a batch's -inf taken
        for a mask, then multiplied through as data): so it is from here on."""
        accidental = replace(origin, deliberate=False)
        self.born[origin.seq] = accidental
        return accidental

    def unborn(self, count: int) -> None:
        """Forget the origins born after the first `count`: copies of a value whose own
        origin is then marked on them (the batch's copy to the device)."""
        del self.born[count:]

    # -- a collective's output: its values may be copied in after it returned ---------
    def expect(self, t: torch.Tensor, lineage: Lineage) -> None:
        """`t` will receive what a collective made of values of this lineage."""
        if (storage := _storage(t)) is not None:
            self._arriving[storage] = lineage

    def arrived(self, t: torch.Tensor) -> Lineage | None:
        """The lineage a collective's output awaited, once (the op writing it is the
        collective's work landing, from a buffer no op of ours saw)."""
        storage = _storage(t)
        return self._arriving.pop(storage, None) if storage is not None else None

    # -- memory an op allocated and left unwritten (`empty_like`): not a value -------
    def allocated(self, t: torch.Tensor) -> None:
        if (storage := _storage(t)) is not None:
            self._unwritten[storage] = True

    def unwritten(self, t: torch.Tensor) -> bool:
        storage = _storage(t)
        return storage is not None and storage in self._unwritten

    def written(self, t: torch.Tensor) -> None:
        if (storage := _storage(t)) is not None:
            self._unwritten.pop(storage, None)


def descend(parents: list[Lineage], created: bool) -> Lineage | None:
    """The lineage an op's non-finite output inherits; None: the op is a new origin.

    The earliest accidental origin among the inputs wins; an op that created a new kind
    of value from deliberate inputs only is a new origin; so is one with no parents.
    """
    accidental = [p for p in parents if not p.origin.deliberate]
    if accidental:
        chosen = min(accidental, key=lambda p: p.origin.seq)
    elif parents and not created:
        chosen = min(parents, key=lambda p: p.origin.seq)
    else:
        return None
    return Lineage(chosen.origin, _ancestors(parents))


def reaching(lineages: list[Lineage]) -> Lineage:
    """Of the lineages of the values at the failure, the one of the earliest origin."""
    return Lineage(min((x.origin for x in lineages), key=lambda o: o.seq), _ancestors(lineages))


def transients(
    born: list[Origin], reached: frozenset[int], failure: Sighting | None = None
) -> list[Transient]:
    """The origins whose values never reached the failure, once each (birth order).
    Not the forward op whose backward is the `failure`: `log(softmax(x))` meeting a 0
    makes -inf that a gather discards, and its backward divides by the same 0; that log
    is the cause, not a value seen on the way."""
    out: list[Transient] = []
    seen: set[tuple] = set()
    for origin in born:
        f = origin.finding
        key = (f.phase, f.module, f.op, f.source, f.value)
        if origin.seq in reached or key in seen or _forward_of(f, failure):
            continue
        seen.add(key)
        out.append(Transient(origin.step, f.phase.value, f.module, f.op, f.value, f.source))
        if len(out) == MAX_TRANSIENTS:
            break
    return out


def _forward_of(found: Sighting, failure: Sighting | None) -> bool:
    """`found` is the forward op at the line whose backward failed ("aten.log.default"
    at train.py:12 for "torch.log (LogBackward0)" there)."""
    if failure is None or not failure.evidence.backward_of or found.source != failure.source:
        return False
    node = failure.evidence.backward_of.split("(")[-1].rstrip(")")
    forward = node.split("Backward")[0].lower()
    op = (found.op or "").split(".")
    return len(op) > 1 and op[1].strip("_").lower() == forward


def _ancestors(lineages: list[Lineage]) -> frozenset[int]:
    return frozenset().union(*(x.ancestors for x in lineages))


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass, sparse
        return None
