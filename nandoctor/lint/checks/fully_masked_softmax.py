"""fully-masked-softmax: a `-inf` fill that reaches a softmax in the same function.

`masked_fill(mask, float("-inf"))`, `torch.where(mask, x, -inf)`, `x[mask] = -math.inf`
and `torch.full(..., -inf)` masks are followed through variables and arithmetic
(`scores + mask`) into `softmax`. A row that is masked everywhere is NaN. Not flagged,
because no row can be fully masked there: causal masks (built with `tril`/`triu` or named
causal), threshold masks of the tensor itself (`logits[logits < kth] = -inf`, top-k
sampling), and code under `torch.no_grad()` or in generate/sample functions.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity
from nandoctor.lint.flow import flow_of
from nandoctor.lint.source import Source
from nandoctor.lint.tags import Kind
from nandoctor.lint.unit import Check, Spot

CAUSAL = re.compile(r"tril|triu|causal|subsequent|look_?ahead|future", re.IGNORECASE)
SAMPLING_WORDS = frozenset(
    {"generate", "generation", "sample", "sampling", "top", "topk", "topp", "nucleus", "beam"}
    | {"greedy"}
)  # NB: words of a function's name, so `downsample` is no sampling
THRESHOLDS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
NameKey = tuple[ast.AST | None, str]  # (scope, local name) or (None, attribute name)

INVALID = (
    """\
import torch
scores = scores.masked_fill(padding_mask, float("-inf"))
attn = torch.softmax(scores, dim=-1)
""",
    """\
import math
import torch.nn.functional as F
def attend(q, k, key_mask):
    bias = torch.zeros_like(key_mask, dtype=q.dtype)
    bias[key_mask] = -math.inf
    return F.softmax(q @ k.transpose(-2, -1) + bias, dim=-1)
""",
)

VALID = (
    """\
import torch
scores = scores.masked_fill(padding_mask, torch.finfo(scores.dtype).min)
attn = torch.softmax(scores, dim=-1)
""",
    """\
import torch
causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
att = att.masked_fill(~causal, float("-inf"))  # every row keeps its diagonal
att = torch.softmax(att, dim=-1)
""",
    """\
import torch
logits[logits < torch.topk(logits, 50).values[:, [-1]]] = -float("inf")  # top-k keeps 50
probs = torch.softmax(logits, dim=-1)
""",
)


def fully_masked_softmax(src: Source) -> Iterator[Spot]:
    causal: list[frozenset[NameKey]] = []  # NB: computed on the first -inf fill only
    seen: set[int] = set()
    for call in src.calls:
        source_tensor = _softmax_input(src, call)
        if source_tensor is None or _sampling(src, call):
            continue
        for tag in flow_of(src).of_kind(source_tensor, Kind.NEG_INF):
            causal = causal or [_causal_names(src)]
            if id(tag.origin) not in seen and not _cannot_fill_a_row(src, tag.origin, causal[0]):
                seen.add(id(tag.origin))
                yield Spot(tag.origin, _message(call))


def _softmax_input(src: Source, call: ast.Call) -> ast.expr | None:
    found = patterns.softmax_input(src, call)
    if found is None and flow_of(src).has(call.func, Kind.SOFTMAX_MODULE):
        found = patterns.first_arg(call)
    return found


def _sampling(src: Source, call: ast.Call) -> bool:
    function = src.function_of(call)
    words = set(re.split(r"_+", function.name.lower())) if function is not None else set()
    return bool(words & SAMPLING_WORDS) or patterns.in_no_grad(src, call)


def _cannot_fill_a_row(src: Source, origin: ast.AST, causal: frozenset[NameKey]) -> bool:
    receiver, mask = _receiver_and_mask(origin)
    statement = next((a for a in src.ancestors(origin) if isinstance(a, ast.stmt)), origin)
    looked_at = mask if mask is not None else statement
    if CAUSAL.search(src.segment(looked_at)) or _keys(src, looked_at) & causal:
        return True
    if mask is None or receiver is None:
        return False
    compares = [n for n in ast.walk(mask) if isinstance(n, ast.Compare)]
    thresholds = any(isinstance(op, THRESHOLDS) for c in compares for op in c.ops)
    return thresholds and bool(_keys(src, receiver) & _keys(src, mask))


def _receiver_and_mask(origin: ast.AST) -> tuple[ast.AST | None, ast.AST | None]:
    if isinstance(origin, ast.Assign) and isinstance(origin.targets[0], ast.Subscript):
        return origin.targets[0].value, origin.targets[0].slice
    if isinstance(origin, ast.Call) and isinstance(origin.func, ast.Attribute):
        if origin.func.attr in ("masked_fill", "masked_fill_"):
            return origin.func.value, patterns.arg(origin, 0, "mask")
        if origin.func.attr == "where" and len(origin.args) == 3:
            return ast.Tuple(elts=origin.args[1:], ctx=ast.Load()), origin.args[0]
    return None, None


def _causal_names(src: Source) -> frozenset[NameKey]:
    """Variables given a value built with tril/triu, or from such a variable (`mask =
    self.bias[:, :, :T, :T]` after `register_buffer("bias", torch.tril(...))`): masks
    derived from them are causal. A local name counts in its own function only."""
    names: set[NameKey] = set()
    for call in src.calls:
        if isinstance(call.func, ast.Attribute) and call.func.attr == "register_buffer":
            first = call.args[0] if call.args else None
            if isinstance(first, ast.Constant) and CAUSAL.search(src.segment(call)):
                names.add((None, str(first.value)))
    assignments = []
    for node in src.nodes_of(ast.Assign, ast.AnnAssign):
        value = node.value
        if value is not None:
            targets = {k for t in _target_nodes(node) for k in _keys(src, t)}
            if CAUSAL.search(src.segment(value)):
                names |= targets
            else:
                assignments.append((targets, _keys(src, value)))
    grew = True
    while grew:  # NB: a fixed point; each round adds names or stops
        before = len(names)
        for targets, used in assignments:
            if used & names:
                names |= targets
        grew = len(names) > before
    return frozenset(names)


def _target_nodes(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign):
        return list(node.targets)
    assert isinstance(node, (ast.AnnAssign, ast.AugAssign))
    return [node.target]


def _keys(src: Source, node: ast.AST) -> set[NameKey]:
    """`(scope, name)` for local names, `(None, attr)` for attributes (`self.bias`)."""
    found: set[NameKey] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id != "self":
            found.add((src.scope_of(n), n.id))
        elif isinstance(n, ast.Attribute):
            found.add((None, n.attr))
    return found


def _message(softmax: ast.Call) -> str:
    return (
        f"Fill with `torch.finfo(x.dtype).min` instead of -inf: this mask reaches the "
        f"softmax on line {softmax.lineno}, and a row masked everywhere (an all-padding "
        f"sequence) gives (-inf) - (-inf) = NaN there."
    )


CHECK = Check(
    id="fully-masked-softmax",
    run=fully_masked_softmax,
    severity=Severity.WARNING,
    summary="A `-inf` mask that flows into a softmax, where a fully masked row is NaN.",
    invalid=INVALID,
    valid=VALID,
)
