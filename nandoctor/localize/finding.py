"""What the replay found: the causal origin of the failure (SPEC's `first_nonfinite`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nandoctor.localize.stats import batch_rows, row_counts, tensor_stats, value_kind
from nandoctor.report.evidence import Evidence
from nandoctor.report.types import Frame, Sample
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.tensors import named_tensors, nonfinite_data
from nandoctor.runtime.verdict import Verdict


@dataclass(frozen=True)
class Sighting:
    """The origin of the non-finite value that reached the failure."""

    phase: Phase
    module: str | None
    op: str | None
    tensor: str
    value: str
    dtype: str
    shape: list[int]
    count: int
    source: str | None
    evidence: Evidence = field(default_factory=Evidence)
    created: bool = True  # False: a deliberate inf (a scalar fill, a constant) carried along
    frames: list[Frame] = field(default_factory=list)  # innermost first; the user's last
    micro_batch: int | None = None  # gradient accumulation: the micro-batch it was born in
    root: int = 0  # the root module `module` is inside: 0 the model, else the step's others
    # (row, count) of the rows along the tensor's first dimension holding its non-finite
    # values: a forward op's, for the samples' search (`samples.py`)
    rows: tuple[tuple[int, int], ...] = ()
    samples: tuple[Sample, ...] = ()  # the batch rows it began in (`samples.py`)


def finding_of(
    phase: Phase,
    module: str | None,
    op: str | None,
    role: str,
    tensor: torch.Tensor,
    source: str | None,
    created: bool = True,
    frames: list[Frame] | None = None,
) -> Sighting:
    """A finding about `tensor`, its statistics read once (the output's evidence)."""
    stats = tensor_stats(role, tensor)
    return Sighting(
        phase=phase,
        module=module,
        op=op,
        tensor=role,
        value=value_kind(stats),
        dtype=stats.dtype,
        shape=stats.shape,
        count=stats.nonfinite,
        source=source,
        evidence=Evidence(output=stats),
        created=created,
        frames=list(frames or []),
    )


def batch_finding(verdict: Verdict) -> Sighting | None:
    """For a failure in the INPUT phase that no replay localised (the `with` form of Guard,
    a replay past its budget or out of memory): the first batch tensor the sentinel kept
    that holds NaN or inf (an additive mask's -inf aside), named as the replay names it
    (`input:labels`). The batch is all it takes to say which tensor held what; under
    `watch` the watched process described it (`Verdict.batch_named`, `named_fields`)."""
    if verdict.phase is not Phase.INPUT:
        return None
    if not verdict.batches and verdict.batch_named is not None:
        named = dict(verdict.batch_named)
        rows = tuple(s if isinstance(s, Sample) else Sample(**s) for s in named.pop("samples", ()))
        return Sighting(Phase.INPUT, None, None, source=None, samples=rows, **named)
    for index, batch in enumerate(verdict.batches):
        for path, t in named_tensors(batch):
            if t.is_floating_point() and bool(nonfinite_data([t], t.device)):
                found = finding_of(Phase.INPUT, None, None, f"input:{path or 'batch'}", t, None)
                micro = index if len(verdict.batches) > 1 else None
                return replace(found, micro_batch=micro, samples=held_rows(t, batch))
    return None


def held_rows(t: torch.Tensor, batch: Any) -> tuple[Sample, ...]:
    """The rows of batch tensor `t` that hold its non-finite values, where its first
    dimension is the batch's (not a sequence-first layout's)."""
    if t.dim() == 0 or t.shape[0] != batch_rows(batch):
        return ()
    return tuple(Sample(row, nonfinite=n) for row, n in row_counts(t))


def named_fields(found: Sighting) -> dict[str, Any]:
    """A batch finding as the plain data `Verdict.batch_named` carries across processes."""
    keys = ("tensor", "value", "dtype", "shape", "count", "micro_batch", "samples")
    return {k: getattr(found, k) for k in keys}
