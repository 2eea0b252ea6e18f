"""What a variable holds at the point where it is read: a tiny, per-function data flow.

One in-order pass over each function (and the module body) remembers, for every name
that is read, the tags of the value last assigned to it in that function:

    probs = F.softmax(logits, -1)          probs: {SOFTMAX}
    p = probs.gather(1, y[:, None])        p:     {SOFTMAX}   (views and gathers keep it)
    loss = -torch.log(p + 1e-8).mean()     the check sees SOFTMAX_EPS inside the log
    probs = torch.sigmoid(z)               probs: {SIGMOID}   (rebinding forgets the softmax)
    ptdtype = {"fp16": torch.float16, ...}[dtype]   ptdtype: {FLOAT16}   (one of its choices)

It is deliberately simple: branches are read in source order, the last assignment wins,
and unknown calls return nothing, so a tag is only ever present when the code says so.
`self.x = ...` in any method tags `self.x` for the whole class (an `nn.Softmax` built in
`__init__`, an `eps` stored there).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable
from typing import Any

from nandoctor.lint import patterns as p
from nandoctor.lint.flowpass import ScopePass
from nandoctor.lint.index import FUNCTIONS
from nandoctor.lint.names import INF_NAMES
from nandoctor.lint.source import Source
from nandoctor.lint.tags import NONE, Kind, Tag, Tags, keep, kinds

__all__ = ["Flow", "Kind", "Tag", "Tags", "flow_of", "is_neg_inf"]


_KEEP_THROUGH_VIEWS = frozenset(Kind) - {
    Kind.CONST,
    Kind.SOFTMAX_MODULE,
    Kind.SIGMOID_MODULE,
    Kind.FLOAT32,
}


def flow_of(src: Source) -> Flow:
    """The file's data flow, computed on the first question and kept by the `Source`."""
    return src.analysis(Flow)


class Flow:
    """Tags of expressions, after one pass over every scope of the file."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self._at: dict[ast.Name, Tags] = {}
        self._attrs: dict[tuple[ast.AST | None, str], Tags] = {}
        self._memo: dict[ast.AST, Tags] | None = None  # filled only once the pass is done
        self._scratch: dict[ast.AST, Tags] = {}  # NB: without it nested sums are exponential
        self._depth = 0
        self.softmax_functions: frozenset[str] = frozenset()  # same-file defs returning one
        self.softmax_classes: frozenset[str] = frozenset()  # modules whose forward does
        self._run_passes()
        if self._summarise_returns():
            self._run_passes()  # NB: a second round lets `model = Net()` see Net's forward

    def _run_passes(self) -> None:
        self._at, self._attrs, self._memo = {}, {}, None
        module_env: dict[str, Tags] = {}
        tree = self.src.tree
        ScopePass(self, tree, self.src.bindings(tree), module_env, {}).run()
        for node in self.src.nodes_of(*FUNCTIONS, ast.ClassDef):
            ScopePass(self, node, self.src.bindings(node), {}, module_env).run()
        self._memo = {}

    def _summarise_returns(self) -> bool:
        """Which functions of this file return a softmax, and which classes' `forward` do:
        `torch.log(model(x))` is a log of a softmax when `Net.forward` ends in one."""
        functions: set[str] = set()
        classes: set[str] = set()
        for node in self.src.nodes_of(ast.Return):
            function = self.src.function_of(node)
            if function is None or not self.has(node.value, Kind.SOFTMAX):
                continue
            functions.add(function.name)
            owner = self.src.class_of(function)
            if owner is not None and function.name in ("forward", "__call__"):
                classes.add(owner.name)
        self.softmax_functions, self.softmax_classes = frozenset(functions), frozenset(classes)
        return bool(functions)

    def record(self, node: ast.Name, tags: Tags) -> None:
        self._at[node] = tags

    def record_attribute(self, target: ast.Attribute, tags: Tags) -> None:
        """`self.x = ...` in any method: `self.x` holds the union of what is assigned."""
        if isinstance(target.value, ast.Name) and target.value.id in ("self", "cls"):
            key = (self.src.class_of(target), target.attr)
            self._attrs[key] = self._attrs.get(key, NONE) | tags

    def tags(self, expr: ast.AST | None) -> Tags:
        if expr is None:
            return NONE
        memo = self._memo if self._memo is not None else self._scratch
        if expr in memo:
            return memo[expr]
        self._depth += 1
        try:
            rule = _RULES.get(type(expr))
            memo[expr] = result = rule(self, expr) if rule else NONE
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._scratch.clear()  # NB: during the pass, memoise one question at a time
        return result

    def has(self, expr: ast.AST | None, kind: Kind) -> bool:
        return any(t.kind is kind for t in self.tags(expr))

    def of_kind(self, expr: ast.AST | None, kind: Kind) -> list[Tag]:
        return [t for t in self.tags(expr) if t.kind is kind]

    def const(self, expr: ast.AST | None) -> float | None:
        """The numeric value of `expr` when the code fixes it (`1e-8`, `EPS`, `self.eps`,
        `float("-inf")`, `-math.inf`), else None."""
        values = {t.value for t in self.of_kind(expr, Kind.CONST)}
        return values.pop() if len(values) == 1 else None

    def attr_tags(self, node: ast.Attribute) -> Tags:
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            return self._attrs.get((self.src.class_of(node), node.attr), NONE)
        return NONE


def _name(flow: Flow, node: ast.Name) -> Tags:
    if flow.src.qualname(node) in p.FLOAT16:  # `from torch import float16 as f16`
        return frozenset({Tag(Kind.FLOAT16, node)})
    return flow._at.get(node, NONE)


def _attribute(flow: Flow, node: ast.Attribute) -> Tags:
    name = flow.src.qualname(node)
    if name in INF_NAMES:
        return frozenset({Tag(Kind.CONST, node, math.inf)})
    if name in p.FLOAT16:
        return frozenset({Tag(Kind.FLOAT16, node)})
    return flow.attr_tags(node)


def _dict(flow: Flow, node: ast.Dict) -> Tags:
    """`{"float32": torch.float32, "float16": torch.float16}`: a lookup in it (`[dtype]`,
    kept by the subscript rule) may give float16, as nanoGPT's `ptdtype` does."""
    return keep((t for v in node.values for t in flow.tags(v)), {Kind.FLOAT16})


def _constant(flow: Flow, node: ast.Constant) -> Tags:
    value = node.value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return frozenset({Tag(Kind.CONST, node, float(value))})
        except OverflowError:  # NB: an int beyond float's range
            return NONE
    return NONE


def _unary(flow: Flow, node: ast.UnaryOp) -> Tags:
    value = flow.const(node.operand)
    if value is not None and isinstance(node.op, (ast.USub, ast.UAdd)):
        return frozenset(
            {Tag(Kind.CONST, node, -value if isinstance(node.op, ast.USub) else value)}
        )
    return NONE


def _subscript(flow: Flow, node: ast.Subscript) -> Tags:
    return keep(flow.tags(node.value), _KEEP_THROUGH_VIEWS)


def _ifexp(flow: Flow, node: ast.IfExp) -> Tags:
    return flow.tags(node.body) | flow.tags(node.orelse)


def _binop(flow: Flow, node: ast.BinOp) -> Tags:
    left, right = flow.tags(node.left), flow.tags(node.right)
    folded = _fold(flow, node)
    if folded is not None:
        return frozenset({Tag(Kind.CONST, node, folded)})
    carried = {Kind.NEG_INF} if isinstance(node.op, ast.MatMult) else {Kind.NEG_INF, Kind.FLOAT32}
    inf = keep(left | right, carried)  # NB: float16 op float32 is float32, but `@` is float16
    if isinstance(node.op, ast.Add):
        return inf | _add(flow, node, left, right)
    if isinstance(node.op, ast.Pow) and flow.const(node.right) == 2.0:
        return inf | {Tag(Kind.SQUARES, node)}
    if isinstance(node.op, ast.Mult) and ast.dump(node.left) == ast.dump(node.right):
        return inf | {Tag(Kind.SQUARES, node)}
    if isinstance(node.op, ast.Div) and Kind.EXP in kinds(left) and _sum_of_exp(right):
        return inf | {Tag(Kind.SOFTMAX, node)}  # e / e.sum(): a softmax written by hand
    if isinstance(node.op, ast.Sub) and flow.const(node.left) == 1 and Kind.SIGMOID in kinds(right):
        return inf | {Tag(Kind.COMPLEMENT, node)}
    return inf


def _sum_of_exp(tags: Tags) -> bool:
    """A sum of exponentials (not `exp(a) / exp(b)`, which is no softmax)."""
    return any(
        t.kind is Kind.EXP
        and isinstance(t.origin, ast.Call)
        and getattr(t.origin.func, "attr", getattr(t.origin.func, "id", "")) in ("sum", "nansum")
        for t in tags
    )


def _add(flow: Flow, node: ast.BinOp, left: Tags, right: Tags) -> Tags:
    """`x + c` marks x as guarded by c; `a**2 + b**2` is still a sum of squares."""
    out: set[Tag] = set()
    for value_side, other, other_tags in ((left, node.right, right), (right, node.left, left)):
        c = flow.const(other)
        if c is not None and 0 < c < 1:
            out.add(Tag(Kind.EPS_ADDED, node, c))
        softmax = {Kind.SOFTMAX, Kind.SOFTMAX_EPS}
        if kinds(value_side) & softmax and not kinds(other_tags) & softmax:
            out.add(Tag(Kind.SOFTMAX_EPS, node, c))  # NB: an unknown eps counts too
    if Kind.SQUARES in kinds(left) and Kind.SQUARES in kinds(right):
        out.add(Tag(Kind.SQUARES, node))
    return frozenset(out)


def _fold(flow: Flow, node: ast.BinOp) -> float | None:
    a, b = flow.const(node.left), flow.const(node.right)
    if a is None or b is None:
        return None
    ops = {ast.Add: a.__add__, ast.Sub: a.__sub__, ast.Mult: a.__mul__, ast.Div: a.__truediv__}
    ops[ast.Pow] = a.__pow__
    try:
        result = ops[type(node.op)](b)
    except (KeyError, ArithmeticError, ValueError):
        return None
    return float(result) if isinstance(result, (int, float)) else None


def _call(flow: Flow, call: ast.Call) -> Tags:
    src = flow.src
    name = p.qualname(src, call)
    attribute = call.func if isinstance(call.func, ast.Attribute) and name is None else None
    method = attribute.attr if attribute is not None else None
    receiver = attribute.value if attribute is not None else None
    if p.softmax_input(src, call) is not None or flow.has(call.func, Kind.SOFTMAX_MODULE):
        return frozenset({Tag(Kind.SOFTMAX, call)})
    if _calls_a_softmax_function(flow, call):
        return frozenset({Tag(Kind.SOFTMAX, call)})
    if name in p.SOFTMAX_MODULES or _builds_a_softmax_module(flow, call, name):
        return frozenset({Tag(Kind.SOFTMAX_MODULE, call)})
    if flow.has(call.func, Kind.SIGMOID_MODULE):
        return frozenset({Tag(Kind.POSITIVE, call), Tag(Kind.SIGMOID, call)})
    if name in p.SIGMOID_MODULES or _ends_in(flow, call, name, Kind.SIGMOID_MODULE):
        return frozenset({Tag(Kind.SIGMOID_MODULE, call)})
    if isinstance(call.func, ast.Name) and call.func.id == "float":
        return _float_literal(call)
    inf = _neg_inf_tags(flow, call, name, method, receiver)
    precision = _float32_tags(flow, call, name, method, receiver)
    return inf | precision | _math_tags(flow, call, name, method, receiver)


def _calls_a_softmax_function(flow: Flow, call: ast.Call) -> bool:
    """`probs(x)` or `self.probs(x)` where this file's `def probs` returns a softmax."""
    func = call.func
    if isinstance(func, ast.Name) and flow.src.qualname(func) is None:
        return func.id in flow.softmax_functions and func.id not in flow.softmax_classes
    if not isinstance(func, ast.Attribute):
        return False
    return getattr(func.value, "id", "") == "self" and func.attr in flow.softmax_functions


def _builds_a_softmax_module(flow: Flow, call: ast.Call, name: str | None) -> bool:
    """`Net()` whose forward returns a softmax; `nn.Sequential(..., nn.Softmax(1))`."""
    if isinstance(call.func, ast.Name) and name is None:
        return call.func.id in flow.softmax_classes
    return _ends_in(flow, call, name, Kind.SOFTMAX_MODULE)


def _ends_in(flow: Flow, call: ast.Call, name: str | None, module: Kind) -> bool:
    """`nn.Sequential(..., nn.Softmax(1))`: a stack whose last module is such a module."""
    return name == "torch.nn.Sequential" and bool(call.args) and flow.has(call.args[-1], module)


def _neg_inf_tags(flow: Flow, call: ast.Call, name, method, receiver) -> Tags:
    if method in ("masked_fill", "masked_fill_") and receiver is not None:
        fill = p.arg(call, 1, "value")
        base = keep(flow.tags(receiver), {Kind.NEG_INF})
        return base | ({Tag(Kind.NEG_INF, call)} if is_neg_inf(flow, fill) else set())
    if name == "torch.where" and len(call.args) == 3:
        _, a, b = call.args
        if is_neg_inf(flow, a) or is_neg_inf(flow, b):
            return frozenset({Tag(Kind.NEG_INF, call)})
        return keep(flow.tags(a) | flow.tags(b), {Kind.NEG_INF})
    if name in ("torch.full", "torch.full_like") and is_neg_inf(flow, p.arg(call, 1, "fill_value")):
        return frozenset({Tag(Kind.NEG_INF, call)})
    return NONE


def _math_tags(flow: Flow, call: ast.Call, name, method, receiver) -> Tags:
    """Tags for sums, norms, squares, exp and clamps, in function or method form."""
    short = method or (name.rsplit(".", 1)[-1] if name and name.startswith("torch.") else None)
    operand = receiver if method else p.first_arg(call)
    if short is None:
        return NONE
    if method in p.VIEW_METHODS or name in p.VIEW_FUNCTIONS:
        return keep(flow.tags(operand), _KEEP_THROUGH_VIEWS)
    if short in p.CLAMPS:
        return frozenset({Tag(Kind.CLAMPED, call)})
    if short in ("exp", "exp_"):
        return frozenset({Tag(Kind.EXP, call)})
    if short in ("sigmoid", "sigmoid_", "expit"):
        return frozenset({Tag(Kind.POSITIVE, call), Tag(Kind.SIGMOID, call)})
    if short == "softplus":
        return frozenset({Tag(Kind.POSITIVE, call)})
    if short in ("square", "square_") or (short in ("pow", "pow_") and _power(flow, call) == 2.0):
        return frozenset({Tag(Kind.SQUARES, call)})
    if short in ("sum", "nansum", "norm", "vector_norm", "std", "var", "mean"):
        return _reduction(flow, call, short, operand)
    return NONE


def _float32_tags(flow: Flow, call: ast.Call, name, method, receiver) -> Tags:
    """FLOAT32 where the code casts to float32 itself (`x.float()`, `.to(torch.float32)`):
    the result stays float32 inside a float16 autocast region, on any device."""
    short = method or (name.rsplit(".", 1)[-1] if name and name.startswith("torch.") else None)
    if method in ("float", "double") or (method in ("to", "type") and _to_float32(flow, call)):
        return frozenset({Tag(Kind.FLOAT32, call)})
    if short is None or short in p.AUTOCAST_FP16 or method in ("to", "type"):
        return NONE
    operand = receiver if method else p.first_arg(call)
    return keep(flow.tags(operand), {Kind.FLOAT32})


def _to_float32(flow: Flow, call: ast.Call) -> bool:
    values = [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]
    wide = {"torch.float32", "torch.float", "torch.float64", "torch.double"}
    return any(flow.src.qualname(v) in wide for v in values)


def _reduction(flow: Flow, call: ast.Call, short: str, operand: ast.expr | None) -> Tags:
    inner = kinds(flow.tags(operand))
    if inner & {Kind.EXP, Kind.POSITIVE}:
        if short not in ("sum", "nansum"):
            return NONE
        return frozenset({Tag(Kind.EXP if Kind.EXP in inner else Kind.POSITIVE, call)})
    if inner & {Kind.SOFTMAX, Kind.CLAMPED}:
        return NONE  # a sum of probabilities is 1; a clamped value is guarded
    out: set[Tag] = set()
    if short == "var" or (Kind.SQUARES in inner and short in ("sum", "nansum", "mean")):
        out.add(Tag(Kind.SQUARES, call))
    if short in ("sum", "nansum", "norm", "vector_norm", "std"):
        out.add(Tag(Kind.ZEROABLE, call))
    return frozenset(out)


def _power(flow: Flow, call: ast.Call) -> float | None:
    exponent = call.args[0] if isinstance(call.func, ast.Attribute) and call.args else None
    if p.qualname(flow.src, call) == "torch.pow":
        exponent = p.arg(call, 1, "exponent")
    return flow.const(exponent)


def _float_literal(call: ast.Call) -> Tags:
    if len(call.args) == 1 and isinstance(call.args[0], ast.Constant):
        try:
            value: Any = call.args[0].value  # a str or None raises below: not a number
            return frozenset({Tag(Kind.CONST, call, float(value))})
        except (TypeError, ValueError):
            return NONE
    return NONE


def is_neg_inf(flow: Flow, expr: ast.AST | None) -> bool:
    return flow.const(expr) == -math.inf


_RULES: dict[type, Callable[[Flow, Any], Tags]] = {
    ast.Name: _name,
    ast.Attribute: _attribute,
    ast.Dict: _dict,
    ast.Constant: _constant,
    ast.UnaryOp: _unary,
    ast.Subscript: _subscript,
    ast.IfExp: _ifexp,
    ast.BinOp: _binop,
    ast.Call: _call,
}
