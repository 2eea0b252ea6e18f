"""The rules of the causal origin, one at a time: what a non-finite output inherits, when
an op is a new origin, which origins are transients, and how a tensor finds its lineage
(itself, a view of it, the storage autograd saved)."""

from __future__ import annotations

import torch

from nandoctor.localize.finding import Sighting
from nandoctor.localize.origins import Lineage, OriginTable, descend, reaching, transients
from nandoctor.runtime.probe import Phase


def finding(op: str, module: str | None = "enc", phase: Phase = Phase.FORWARD) -> Sighting:
    return Sighting(phase, module, op, "output", "-inf", "float32", [3], 1, "train.py:9")


def born(table: OriginTable, op: str, deliberate: bool = False, *parents: Lineage) -> Lineage:
    return table.birth(finding(op), 4, deliberate, list(parents))


def test_an_op_with_no_nonfinite_input_is_a_new_origin():
    assert descend([], created=True) is None
    assert descend([], created=False) is None  # a fill from a scalar: new, deliberate


def test_the_earliest_accidental_parent_wins_over_a_deliberate_one():
    table = OriginTable()
    mask = born(table, "aten.masked_fill.Scalar", True)
    first, second = born(table, "aten.log.default"), born(table, "aten.exp.default")
    lineage = descend([mask, second, first], created=True)
    assert lineage is not None and lineage.origin is first.origin
    assert lineage.ancestors == {mask.origin.seq, first.origin.seq, second.origin.seq}


def test_a_nan_made_from_deliberate_infs_alone_is_a_new_origin():
    table = OriginTable()
    mask = born(table, "aten.masked_fill.Scalar", True)
    assert descend([mask], created=True) is None  # the softmax of a fully masked row
    carried = descend([mask], created=False)  # the -inf merely carried along
    assert carried is not None and carried.origin is mask.origin


def test_a_deliberate_origin_found_to_be_data_is_accidental_from_then_on():
    table = OriginTable()
    batch = table.birth(finding("input:0", None, Phase.INPUT), 4, True, [])
    data = table.as_data(batch.origin)
    assert not data.deliberate and data.seq == batch.origin.seq
    assert table.born == [data]  # reported as any accidental origin is
    assert descend([Lineage(data, batch.ancestors)], created=True).origin is data


def test_transients_are_the_origins_that_did_not_reach_the_failure_once_each():
    table = OriginTable()
    healed = born(table, "aten.log.default")
    born(table, "aten.log.default")  # the same op at the same line again
    mask = born(table, "aten.masked_fill.Scalar", True)
    failure = born(table, "aten.div.Tensor", False, mask)
    reached = reaching([failure])
    assert reached.origin is failure.origin
    listed = transients(table.born, reached.ancestors)
    assert [(t.op, t.step, t.phase, t.module) for t in listed] == [
        ("aten.log.default", 4, "forward", "enc")
    ]
    assert healed.origin.seq not in reached.ancestors


def test_a_view_and_a_tensor_on_the_same_storage_find_the_lineage():
    table = OriginTable()
    t = torch.tensor([1.0, float("-inf")])
    lineage = born(table, "aten.log.default")
    table.mark(t, lineage)
    assert table.lineage(t[1:]) is lineage  # another object, the same storage
    assert table.lineage(t.detach()) is lineage
    assert table.lineage(torch.tensor([float("-inf")])) is None


def test_memory_stays_unwritten_until_an_op_writes_it():
    table = OriginTable()
    buffer = torch.empty(4)
    table.allocated(buffer)
    assert table.unwritten(buffer) and table.unwritten(buffer[:2])
    table.written(buffer[:2])
    assert not table.unwritten(buffer)
