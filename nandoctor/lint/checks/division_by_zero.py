"""division-by-zero (heuristic): dividing by a bare sum, norm or std.

`x / x.sum(-1, keepdim=True)`, `loss / mask.sum()`, `v / v.norm()`, `(x - m) / x.std()`:
each is 0/0 = NaN for an all-zero row, an empty mask or a constant input. Not flagged: a
denominator with an epsilon added or clamped (`.clamp_min(1)`, `+ 1e-6`), a sum of
exponentials, sigmoids or probabilities (never 0 by construction), a division inside an
`if` that tests the denominator, and code that is not differentiated (data loading,
metrics: see nondifferentiable-point for what counts).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity, pointer
from nandoctor.lint.flow import flow_of
from nandoctor.lint.grad import on_differentiated_path
from nandoctor.lint.index import Located
from nandoctor.lint.source import Source
from nandoctor.lint.tags import Kind
from nandoctor.lint.unit import Check, Spot

INVALID = (
    """\
import torch
def masked_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum()
masked_mean(l, m).backward()
""",
    """\
import torch
class Head(torch.nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)
""",
)

VALID = (
    """\
import torch
import torch.nn.functional as F
def masked_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum().clamp_min(1)
unit = F.normalize(x, dim=-1)
e = torch.exp(x - x.amax(-1, keepdim=True))
p = e / e.sum(-1, keepdim=True)  # a sum of exponentials is at least 1
masked_mean(l, m).backward()
""",
)


def division_by_zero(src: Source) -> Iterator[Spot]:
    for node in src.nodes_of(ast.BinOp, ast.AugAssign, ast.Call):
        denominator = _denominator(src, node)
        if denominator is None or not on_differentiated_path(src, node):
            continue
        if patterns.guarded(src, node, denominator):
            continue
        zeroable = flow_of(src).of_kind(denominator, Kind.ZEROABLE)
        if zeroable:
            yield Spot(node, _message(src, denominator, zeroable[0].origin))


def _denominator(src: Source, node: ast.AST) -> ast.expr | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return node.right
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
        return node.value
    if isinstance(node, ast.Call):
        if src.qualname(node.func) in ("torch.div", "torch.true_divide"):
            return patterns.arg(node, 1, "other")
        if patterns.method_receiver(src, node, frozenset({"div", "div_"})) is not None:
            return patterns.arg(node, 0, "other")
    return None


def _message(src: Source, denominator: ast.expr, origin: Located) -> str:
    text = src.segment(denominator)
    where = pointer(denominator, origin)
    return (
        f"Clamp the denominator `{text}`{where} (`.clamp_min(1)` for counts, `1e-6` for "
        f"norms) or add an epsilon: when it is 0 the division gives NaN (0/0) or inf."
    )


CHECK = Check(
    id="division-by-zero",
    run=division_by_zero,
    severity=Severity.INFO,
    summary="Division by a sum, norm or std with no epsilon or clamp, on a differentiated path.",
    invalid=INVALID,
    valid=VALID,
    heuristic=True,
)
