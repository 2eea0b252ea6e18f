"""Turn tensors into `TensorStats` (host numbers) for the evidence. Replay-only: each
call reads back to the host, which the fast path never does."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from nandoctor.report.evidence import TensorStats
from nandoctor.runtime.tensors import named_tensors


def tensor_stats(name: str, t: torch.Tensor) -> TensorStats:
    x = t.detach()
    if x.layout != torch.strided:  # a sparse batch: its values where they are stored
        x = x.to_dense()
    if x.is_complex():
        x = x.abs()
    finite = torch.isfinite(x)
    values = x[finite].float() if x.is_floating_point() else x.reshape(-1).float()
    counts = torch.stack(
        [
            (x == 0).sum(),
            (x < 0).sum(),
            torch.isnan(x).sum(),
            (x == float("inf")).sum(),
            (x == float("-inf")).sum(),
        ]
    ).tolist()
    lo, hi, absmax = (
        (values.min(), values.max(), values.abs().max()) if values.numel() else (0, 0, 0)
    )
    return TensorStats(
        name=name,
        dtype=str(x.dtype).removeprefix("torch."),
        shape=list(x.shape),
        numel=x.numel(),
        absmax=float(absmax),
        min=float(lo),
        max=float(hi),
        zeros=int(counts[0]),
        negatives=int(counts[1]),
        nan=int(counts[2]),
        posinf=int(counts[3]),
        neginf=int(counts[4]),
        dtype_max=float(torch.finfo(x.dtype).max) if x.is_floating_point() else None,
    )


def value_kind(stats: TensorStats) -> str:
    """SPEC's `value`: nan | inf | -inf | mixed."""
    kinds = [k for k, n in (("nan", stats.nan), ("inf", stats.posinf), ("-inf", stats.neginf)) if n]
    return kinds[0] if len(kinds) == 1 else "mixed"


def kinds_of(tensors: list[torch.Tensor]) -> list[tuple[bool, bool]]:
    """(has NaN, has ±inf) of each tensor, in one read to the host."""
    out = [(False, False)] * len(tensors)
    floats = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]
    if not floats:
        return out
    device = tensors[floats[0]].device
    flags = [
        torch.stack([torch.isnan(tensors[i]).any(), torch.isinf(tensors[i]).any()]).to(device)
        for i in floats
    ]
    for i, (nan, inf) in zip(floats, torch.stack(flags).tolist(), strict=True):
        out[i] = (bool(nan), bool(inf))
    return out


def row_counts(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """`(row, count)` of each row along the first dimension that holds NaN or inf."""
    if t.dim() == 0 or t.shape[0] == 0:
        return ()
    x = t.detach()
    if x.layout != torch.strided:
        x = x.to_dense()
    per_row = (~torch.isfinite(x)).reshape(x.shape[0], -1).sum(1)
    rows = per_row.nonzero().reshape(-1)
    return tuple(zip(rows.tolist(), per_row[rows].tolist(), strict=True))


def batch_rows(batch: Any) -> int | None:
    """The batch's size along its first dimension: the leading size most of its tensors
    share (a mask or an embedding table beside them may not); None without tensors."""
    data = [t for _, t in named_tensors(batch) if t.dim() > 0 and not t.requires_grad]
    sizes = Counter(t.shape[0] for t in data)
    return sizes.most_common(1)[0][0] if sizes else None
