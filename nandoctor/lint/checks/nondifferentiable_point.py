"""nondifferentiable-point (heuristic): sqrt of a sum of squares, acos/asin unclamped.

The forward is fine; the backward is inf * 0 = NaN where the sum of squares is 0
(identical points) or where the cosine reaches +-1. Only in differentiated code: a
module's `forward`, a loss function, code that calls `.backward()`, and the functions of
the file they call; not under `torch.no_grad()`.
`torch.norm` and `torch.linalg.vector_norm` are not flagged: they define a zero gradient
at 0.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity
from nandoctor.lint.flow import flow_of
from nandoctor.lint.grad import on_differentiated_path
from nandoctor.lint.source import Source
from nandoctor.lint.tags import Kind
from nandoctor.lint.unit import Check, Spot

ARC = frozenset({"acos", "asin", "arccos", "arcsin"})

INVALID = (
    """\
import torch
def pairwise_distance(a, b):
    return torch.sqrt(((a - b) ** 2).sum(-1))
loss = pairwise_distance(x, y).mean()
loss.backward()
""",
    """\
import torch
import torch.nn.functional as F
angle = torch.acos(F.cosine_similarity(u, v, dim=-1))
angle.mean().backward()
""",
)

VALID = (
    """\
import torch
dist = torch.linalg.vector_norm(a - b, dim=-1)  # gradient 0 at 0
dist = torch.sqrt(((a - b) ** 2).sum(-1) + 1e-8)
angle = torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6))
loss = (dist + angle).mean()
loss.backward()
""",
    """\
import torch
with torch.no_grad():
    rms = torch.sqrt((x ** 2).mean())  # not differentiated
""",
)


def nondifferentiable_point(src: Source) -> Iterator[Spot]:
    for node in src.nodes_of(ast.BinOp, ast.Call):
        hit = _sqrt(src, node) or _arc(src, node)
        if hit is not None and on_differentiated_path(src, node):
            yield hit  # NB: `if d > 0: sqrt(d)` is no guard for the gradient of d


def _sqrt(src: Source, node: ast.BinOp | ast.Call) -> Spot | None:
    argument = _sqrt_argument(src, node)
    if argument is None or not flow_of(src).has(argument, Kind.SQUARES):
        return None
    return Spot(
        node,
        f"Use `torch.linalg.vector_norm` or add an epsilon inside the sqrt of "
        f"`{_short(src, argument)}`: where that sum of squares is 0 the gradient is "
        f"inf * 0 = NaN.",
    )


def _sqrt_argument(src: Source, node: ast.BinOp | ast.Call) -> ast.expr | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return node.left if flow_of(src).const(node.right) == 0.5 else None
    if not isinstance(node, ast.Call):
        return None
    name = src.qualname(node.func)
    if name == "torch.sqrt":
        return patterns.first_arg(node)
    if name == "torch.pow":
        power = patterns.arg(node, 1, "exponent")
        return patterns.first_arg(node) if flow_of(src).const(power) == 0.5 else None
    receiver = patterns.method_receiver(src, node, frozenset({"sqrt", "pow"}))
    if receiver is None or (_fn(node) == "pow" and _exponent(src, node) != 0.5):
        return None
    return receiver


def _exponent(src: Source, call: ast.Call) -> float | None:
    return flow_of(src).const(call.args[0]) if call.args else None


def _arc(src: Source, node: ast.BinOp | ast.Call) -> Spot | None:
    if not isinstance(node, ast.Call):
        return None
    name = src.qualname(node.func) or ""
    if name.startswith("torch.") and name.rsplit(".", 1)[-1] in ARC:
        argument = patterns.first_arg(node)
    else:
        argument = patterns.method_receiver(src, node, ARC)
    if argument is None or flow_of(src).has(argument, Kind.CLAMPED):
        return None
    return Spot(
        node,
        f"Clamp the argument into (-1, 1) before `{_fn(node)}`, e.g. `.clamp(-1 + 1e-6, "
        f"1 - 1e-6)`: its derivative is infinite at +-1, which a cosine of identical "
        f"vectors reaches, and the gradient turns NaN.",
    )


def _fn(call: ast.Call) -> str:
    return call.func.attr if isinstance(call.func, ast.Attribute) else ast.unparse(call.func)


def _short(src: Source, node: ast.AST) -> str:
    text = src.segment(node)
    return text if len(text) <= 40 else text[:37] + "..."


CHECK = Check(
    id="nondifferentiable-point",
    run=nondifferentiable_point,
    severity=Severity.INFO,
    summary="`sqrt` of a sum of squares or `acos`/`asin` of an unclamped value on a "
    "differentiated path.",
    invalid=INVALID,
    valid=VALID,
    heuristic=True,
)
