"""A small character plot of several series on shared axes, for terminals and logs.

    2.31 ┤ff
         │  hfb
         │     bbfb
    0.40 ┤         bbbbbbbbbbbbffff
         └──────────────────────────
          0                      399

Each series has a one-letter marker; × marks where a series went non-finite.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

NONFINITE = "×"


def overlay(
    series: Mapping[str, tuple[Sequence[int], Sequence[float]]],
    markers: dict[str, str],
    width: int = 60,
    height: int = 10,
) -> list[str]:
    points = [(x, y) for xs, ys in series.values() for x, y in zip(xs, ys, strict=False)]
    finite = [y for _, y in points if _finite(y)]
    if not points or not finite:
        return []
    x_lo, x_hi = min(x for x, _ in points), max(x for x, _ in points)
    y_lo, y_hi = min(finite), max(finite)
    grid = [[" "] * width for _ in range(height)]
    for label, (xs, ys) in series.items():
        for x, y in zip(xs, ys, strict=False):
            col = _scale(x, x_lo, x_hi, width)
            if _finite(y):
                grid[height - 1 - _scale(y, y_lo, y_hi, height)][col] = markers[label]
            else:
                grid[0][col] = NONFINITE
    return _frame(grid, (x_lo, x_hi), (y_lo, y_hi))


def _frame(grid: list[list[str]], xs: tuple[int, int], ys: tuple[float, float]) -> list[str]:
    top, bottom = f"{ys[1]:.3g}", f"{ys[0]:.3g}"
    pad = max(len(top), len(bottom))
    lines = []
    for i, row in enumerate(grid):
        label = top if i == 0 else (bottom if i == len(grid) - 1 else "")
        tick = "┤" if label else "│"
        lines.append(f"{label:>{pad}} {tick}{''.join(row)}")
    width = len(grid[0])
    lines.append(" " * pad + " └" + "─" * width)
    left, right = str(xs[0]), str(xs[1])
    lines.append(" " * (pad + 2) + left + right.rjust(width - len(left)))
    return lines


def _scale(value: float, lo: float, hi: float, n: int) -> int:
    if hi == lo:
        return 0
    return min(n - 1, max(0, int((value - lo) / (hi - lo) * (n - 1) + 0.5)))


def _finite(y: float | None) -> bool:
    return y is not None and math.isfinite(y)
