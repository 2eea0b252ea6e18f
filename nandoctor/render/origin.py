"""The "where" of a failure for the terminal: the op and tensor, the module as a path
from the root, the user's source line with the code around it, the op's inputs, who made
them, and what float32 makes of the same op. Reads the report only (and the source file
the report names)."""

from __future__ import annotations

import math
from pathlib import Path

from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table
from rich.tree import Tree

from nandoctor.report.evidence import Evidence, TensorStats
from nandoctor.report.types import FirstNonfinite, Report

CONTEXT_LINES = 3


def origin_block(report: Report) -> RenderableType | None:
    first = report.first_nonfinite
    if first is None or not first.reproduced:
        return None
    parts: list[RenderableType] = [_where(first, report.evidence)]
    code = source_excerpt(first.source)
    if code is not None:
        parts.append(code)
    evidence = report.evidence
    if evidence is not None and evidence.inputs:
        parts.append(inputs_table(evidence.inputs))
    if evidence is not None:
        parts.extend(escape(line) for line in _provenance(evidence))
    return Group(*parts)


def _where(first: FirstNonfinite, evidence: Evidence | None) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    if first.op:
        backward = (
            f" (in the backward of {evidence.backward_of})"
            if evidence and evidence.backward_of
            else ""
        )
        grid.add_row("op", escape(first.op + backward))
    count = (
        f"{first.count_nonfinite} × {first.value}"
        if first.count_nonfinite is not None
        else first.value
    )
    grid.add_row("tensor", escape(f"{first.tensor}: {count} in {first.dtype} {first.shape}"))
    grid.add_row("module", module_tree(first.module, evidence))
    if first.source:
        grid.add_row("source", escape(first.source))
    return grid


def module_tree(path: str | None, evidence: Evidence | None) -> RenderableType:
    if path is None:
        return "(outside the model: in the loss or the training loop)"
    types = {m.module: m.type for m in evidence.modules} if evidence else {}
    tree = Tree(escape(f"(root) {types.get('', '')}".rstrip()))
    node, so_far = tree, []
    for part in path.split(".") if path else []:
        so_far.append(part)
        name = ".".join(so_far)
        node = node.add(escape(f"{part} {types.get(name, '')}".rstrip()))
    return tree


def source_excerpt(source: str | None) -> Syntax | None:
    """A few lines of the user's code around `path:line`, the line highlighted."""
    if not source or ":" not in source:
        return None
    path, _, line = source.rpartition(":")
    if not (line.isdigit() and Path(path).is_file()):
        return None
    n = int(line)
    return Syntax.from_path(
        path,
        line_numbers=True,
        line_range=(max(1, n - CONTEXT_LINES), n + CONTEXT_LINES),
        highlight_lines={n},
        theme="ansi_dark",
    )


def inputs_table(inputs: list[TensorStats]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("input", "tensor", "|x| max", "min", "max", "zeros", "non-finite"):
        table.add_column(column, justify="left" if column in ("input", "tensor") else "right")
    for s in inputs:
        fraction = s.fraction_of_dtype_max
        near = f" ({fraction:.0%} of max)" if fraction is not None and fraction >= 0.01 else ""
        table.add_row(
            escape(s.name),
            escape(f"{s.dtype} {s.shape}"),
            _num(s.absmax) + near,
            _num(s.min),
            _num(s.max),
            str(s.zeros),
            str(s.nonfinite),
        )
    return table


def _provenance(evidence: Evidence) -> list[str]:
    lines = []
    for p in evidence.producers:
        where = f" in {p.module or '(root)'}" if p.module is not None else ""
        at = f" at {p.source}" if p.source else ""
        indent = "   " * (p.depth - 1)
        lines.append(f"{indent}← {p.feeds} came from {p.op}{where}{at} ({p.phase})")
    r = evidence.recompute
    if r is not None and r.error is None:
        if r.finite:
            peak = _num(r.absmax)
            lines.append(
                f"in float32 the same op stays finite (|x| max {peak}): a precision problem"
            )
        else:
            lines.append(
                "in float32 the same op is still non-finite: the math itself, not the precision"
            )
    return lines


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if math.isfinite(x) else str(x)
