"""The "where" of a failure for the terminal: the op and tensor, the module as a path
from the root, the user's source line with the code around it and the library lines on
the way to the op, the op's inputs, who made them, what float32 makes of the same op, and
the non-finite values that healed before the failure. Reads the report only (and the
source file the report names)."""

from __future__ import annotations

import math
from pathlib import Path

from rich import box
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table
from rich.tree import Tree

from nandoctor.causes.case import op_base
from nandoctor.causes.words import MEETS_ZERO, value_word
from nandoctor.report.evidence import Evidence, TensorStats
from nandoctor.report.types import FirstNonfinite, Report, Sample, Transient

CONTEXT_LINES = 3
TRANSIENTS_SHOWN = 5
# `first_nonfinite.reproduced` of a replay that named an origin, as the terminal says it
REPLAYED_ORIGIN = {
    "exact": "reproduced exactly",
    "values-differ": "reproduced, with other values than the run's (nondeterministic)",
}
SAMPLES_NAMED = 5  # batch rows named in the text; the JSON report lists them all


def origin_block(report: Report) -> RenderableType | None:
    first = report.first_nonfinite
    parts: list[RenderableType] = []
    if first is not None and first.reproduced in REPLAYED_ORIGIN:
        parts.append(_where(first, report.evidence))
        code = source_excerpt(first.source)
        if code is not None:
            parts.append(code)
        evidence = report.evidence
        if evidence is not None and evidence.inputs:
            parts.append(inputs_table(evidence.inputs))
        if evidence is not None:
            parts.extend(escape(line) for line in _provenance(evidence, first))
    parts.extend(escape(line) for line in transient_lines(report.transients))
    return Group(*parts) if parts else None


def transient_lines(transients: list[Transient]) -> list[str]:
    """The values that healed before the failure: seen, and not the cause."""
    if not transients:
        return []
    lines = ["healed on the way (seen, not the cause):"]
    lines += [f"  {transient_text(t)}" for t in transients[:TRANSIENTS_SHOWN]]
    if len(transients) > TRANSIENTS_SHOWN:
        lines.append(f"  ... and {len(transients) - TRANSIENTS_SHOWN} more in the JSON report")
    return lines


def transient_text(t: Transient) -> str:
    """`aten.log.default in encoder.block.0 at train.py:31 (forward, -inf)`"""
    where = " outside the model" if t.module is None else f" in {t.module or '(root)'}"
    at = f" at {t.source}" if t.source else ""
    return f"{t.op or 'an op'}{where}{at} ({t.phase}, {t.value})"


def samples_text(samples: list[Sample]) -> str | None:
    """`sample 17 of the batch (dataset index 1843)`; several named, the rest counted."""
    if not samples:
        return None
    word = "sample" if len(samples) == 1 else "samples"
    text = f"{word} {_listed([str(s.row) for s in samples])} of the batch"
    indices = [s.index for s in samples]
    if all(i is not None for i in indices):
        word = "index" if len(samples) == 1 else "indices"
        text += f" (dataset {word} {_listed([str(i) for i in indices])})"
    return text


def _listed(items: list[str]) -> str:
    """`3`, `3 and 17`, `3, 17 and 20`, `3, 17, 20, 41, 60 and 7 more`."""
    shown, rest = items[:SAMPLES_NAMED], len(items) - SAMPLES_NAMED
    if rest > 0:
        return f"{', '.join(shown)} and {rest} more"
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} and {shown[-1]}"


def library_frames(first: FirstNonfinite) -> list[str]:
    """`file:line` of the library frames that issued the op, innermost first."""
    return [f"{f.file}:{f.line}" for f in first.frames if not f.user]


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
    value = value_word(first.value, evidence.output if evidence else None)
    count = f"{first.count_nonfinite} × {value}" if first.count_nonfinite is not None else value
    grid.add_row("tensor", escape(f"{first.tensor}: {count} in {first.dtype} {first.shape}"))
    rows = samples_text(first.samples)
    if rows is not None:
        grid.add_row("in", escape(rows))
    grid.add_row("module", module_tree(first.module, evidence, first.phase))
    if first.source:
        grid.add_row("source", escape(first.source))
    via = library_frames(first)
    if via:
        grid.add_row("via", escape("\n".join(via)))
    if first.reproduced in REPLAYED_ORIGIN and first.reproduced != "exact":
        grid.add_row("replay", REPLAYED_ORIGIN[first.reproduced])
    return grid


def module_tree(
    path: str | None, evidence: Evidence | None, phase: str | None = None
) -> RenderableType:
    if path is None:  # NB: a forward outside the model is another root module's (a GAN's D)
        if phase == "forward":
            return "(outside the model: in another module the step called)"
        if phase == "input":  # NB: the batch, as it reached the model
            return "(none: the batch the model was called with)"
        return "(outside the model: in the loss or the training loop)"
    types = {m.module: m.type for m in evidence.modules} if evidence else {}
    tree = Tree(escape(f"(root) {types.get('', '')}".rstrip()))
    node, so_far = tree, []
    for part in path.split(".") if path else []:
        so_far.append(part)
        name = ".".join(so_far)
        node = node.add(escape(f"{part} {types.get(name, '')}".rstrip()))
    return tree


def source_line(source: str | None) -> str | None:
    """The user's line at `path:line`, when the file is still there."""
    if not source or ":" not in source:
        return None
    path, _, line = source.rpartition(":")
    if not (line.isdigit() and Path(path).is_file()):
        return None
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    n = int(line)
    return lines[n - 1] if 0 < n <= len(lines) else None


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


def _provenance(evidence: Evidence, first: FirstNonfinite) -> list[str]:
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
        elif _zeros_count(evidence, first) and any(
            i.dtype in ("float16", "bfloat16") for i in evidence.inputs
        ):  # NB: recomputed from the inputs as they are: a zero an earlier half-precision
            # op rounded to (x*x underflowing, 1e-8 that is 0 in float16) stays a zero
            lines.append(
                "in float32 the same op on these inputs is still non-finite; their exact "
                "zeros may come from an earlier op's lower precision (see the causes)"
            )
        else:
            lines.append(
                "in float32 the same op is still non-finite: the math itself, not the precision"
            )
    return lines


def _zeros_count(evidence: Evidence, first: FirstNonfinite) -> bool:
    """The inputs' exact zeros had a part in the non-finite value: a NaN (0/0, 0 * inf)
    or an op a zero makes infinite (x/0, log 0); not an overflow of a matmul whose inputs
    hold ReLU's zeros."""
    if not any(i.zeros for i in evidence.inputs):
        return False
    return first.value in ("nan", "mixed") or op_base(first.op or "") in MEETS_ZERO


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if math.isfinite(x) else str(x)
