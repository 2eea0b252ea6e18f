"""A one-line plot of a series, for terminals and Markdown alike.

>>> sparkline([1, 2, 3, 4, float("nan")])
'▁▃▆█×'
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_BARS = "▁▂▃▄▅▆▇█"
NONFINITE = "×"


def sparkline(values: Sequence[float | None], width: int = 60, log: bool = False) -> str:
    """Downsample to `width` columns (the last value always kept); × marks non-finite."""
    points = _downsample([_num(v) for v in values], width)
    finite = [_scaled(v, log) for v in points if v is not None and math.isfinite(v)]
    if not finite:
        return NONFINITE * len(points)
    lo, hi = min(finite), max(finite)
    out = []
    for v in points:
        if v is None or not math.isfinite(v):
            out.append(NONFINITE)
        else:
            level = 0 if hi == lo else (_scaled(v, log) - lo) / (hi - lo)
            out.append(_BARS[min(len(_BARS) - 1, int(level * len(_BARS)))])
    return "".join(out)


def column(index: int, count: int, width: int = 60) -> int:
    """The column of `sparkline` (of `count` values, `width` columns) that shows value
    `index`: where a marker under the line points at it."""
    if count <= width:
        return index
    return next(i for i in range(width) if index < (i + 1) * count // width)


def _num(v: float | str | None) -> float | None:
    if v is None:
        return None
    return float(v)


def _scaled(v: float, log: bool) -> float:
    return math.log10(max(v, 1e-30)) if log else v


def _downsample(values: list[float | None], width: int) -> list[float | None]:
    """Keep a non-finite value visible: each column shows it if any value it covers has it."""
    if len(values) <= width:
        return values
    out: list[float | None] = []
    for i in range(width):
        chunk = values[i * len(values) // width : (i + 1) * len(values) // width] or [values[-1]]
        bad = [v for v in chunk if v is None or not math.isfinite(v)]
        out.append(bad[0] if bad else chunk[-1])
    return out
