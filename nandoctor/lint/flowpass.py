"""The in-order pass over one scope that records what each name holds where it is read.

Statements are visited in source order, a right-hand side before its targets, a
comprehension's generators before its element; nested functions and classes are their own
scopes and are skipped here (their defaults and decorators belong to this one).

The pass asks the data flow it fills (`lint.flow.Flow`) for the tags of each right-hand
side, and records in it what each name holds where it is read; it knows the flow only as
a `DataFlow`, so this module imports neither the flow nor the `Source`.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Protocol

from nandoctor.lint.index import FUNCTIONS, Located, Scope
from nandoctor.lint.tags import NONE, Kind, Tag, Tags, keep

INPLACE_CLAMPS = frozenset({"clamp_", "clamp_min_", "clip_"})


class DataFlow(Protocol):
    """What the pass needs of the data flow: the tags of an expression, its numeric value,
    and a place for what each name read (or `self.x` assigned) holds."""

    def tags(self, expr: ast.AST | None) -> Tags: ...

    def const(self, expr: ast.AST | None) -> float | None: ...

    def record(self, node: ast.Name, tags: Tags) -> None: ...

    def record_attribute(self, target: ast.Attribute, tags: Tags) -> None: ...


class ScopePass:
    """`local`: the names `scope` binds itself (a name read before its assignment in a
    function holds nothing, not the module's value)."""

    def __init__(
        self,
        flow: DataFlow,
        scope: Scope,
        local: frozenset[str],
        env: dict[str, Tags],
        fallback: Mapping[str, Tags],
    ) -> None:
        self.flow = flow
        self.scope = scope
        self.env = env
        self.fallback = fallback
        self.local = local

    def run(self) -> None:
        if isinstance(self.scope, FUNCTIONS):
            self._bind_parameters(self.scope.args)
        body = self.scope.body
        for stmt in body if isinstance(body, list) else [body]:
            self.visit(stmt)

    def _bind_parameters(self, args: ast.arguments) -> None:
        """A parameter holds its default when it has a numeric one (`eps=1e-12`)."""
        positional = [*args.posonlyargs, *args.args]
        defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults))
        pairs = list(zip(positional, [*defaults, *args.defaults], strict=True))
        pairs += list(zip(args.kwonlyargs, args.kw_defaults, strict=True))
        for arg, default in pairs:
            self.env[arg.arg] = keep(self.flow.tags(default), {Kind.CONST}) if default else NONE

    def visit(self, node: ast.AST) -> None:
        handler = getattr(self, f"visit_{type(node).__name__}", None)
        if handler is not None:
            handler(node)
        else:
            for child in ast.iter_child_nodes(node):
                self.visit(child)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            if node.id in self.env:
                self.flow.record(node, self.env[node.id])
            elif node.id not in self.local:
                self.flow.record(node, self.fallback.get(node.id, NONE))
        else:
            self.env[node.id] = NONE

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for expr in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)
        self.env[node.name] = NONE

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for expr in [*node.decorator_list, *node.bases, *(k.value for k in node.keywords)]:
            self.visit(expr)
        self.env[node.name] = NONE

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in [*node.args.defaults, *node.args.kw_defaults]:
            if expr is not None:
                self.visit(expr)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self.bind(target, node.value, node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self.bind(node.target, node.value, node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self.visit(node.value)
        self.bind(node.target, node.value, node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self.visit(node.value)
        if not isinstance(node.target, ast.Name):
            self.visit(node.target)
            return
        current = ast.copy_location(ast.Name(id=node.target.id, ctx=ast.Load()), node.target)
        self.visit_Name(current)
        combined = ast.copy_location(ast.BinOp(left=current, op=node.op, right=node.value), node)
        self.env[node.target.id] = self.flow.tags(combined)

    def visit_For(self, node: ast.For | ast.AsyncFor) -> None:
        self.visit(node.iter)
        self.bind(node.target, None, node)
        for stmt in [*node.body, *node.orelse]:
            self.visit(stmt)

    visit_AsyncFor = visit_For

    def visit_With(self, node: ast.With | ast.AsyncWith) -> None:
        for item in node.items:
            self.visit(item.context_expr)
            if item.optional_vars is not None:
                self.bind(item.optional_vars, None, node)
        for stmt in node.body:
            self.visit(stmt)

    visit_AsyncWith = visit_With

    def visit_ListComp(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp) -> None:
        for generator in node.generators:
            self.visit(generator)
        self.visit(node.elt)

    visit_SetComp = visit_GeneratorExp = visit_ListComp

    def visit_DictComp(self, node: ast.DictComp) -> None:
        for generator in node.generators:
            self.visit(generator)
        self.visit(node.key)
        self.visit(node.value)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self.visit(node.iter)
        self.bind(node.target, None, None)
        for condition in node.ifs:
            self.visit(condition)

    def visit_Expr(self, node: ast.Expr) -> None:
        self.visit(node.value)
        call = node.value
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            receiver = call.func.value
            if isinstance(receiver, ast.Name):
                self._inplace(receiver.id, call.func.attr, call)

    def _inplace(self, name: str, method: str, call: ast.Call) -> None:
        """`x.masked_fill_(m, -inf)` tags x; `x.clamp_(min=1)` guards it."""
        current = self.env.get(name, NONE)
        if method == "masked_fill_":
            self.env[name] = current | keep(self.flow.tags(call), {Kind.NEG_INF})
        elif method == "fill_" and call.args and self.flow.const(call.args[0]) == float("-inf"):
            self.env[name] = current | {Tag(Kind.NEG_INF, call)}
        elif method in INPLACE_CLAMPS:
            self.env[name] = frozenset({Tag(Kind.CLAMPED, call)})
        elif method == "add_":
            self.env[name] = keep(current, {Kind.NEG_INF})

    def bind(self, target: ast.AST, value: ast.expr | None, stmt: Located | None) -> None:
        """`target` now holds `value` (None: something unknown, a loop's item). `stmt` is
        the statement that binds it (None in a comprehension): a -inf written into an item
        (`scores[mask] = -inf`) is tagged with it."""
        tags = self.flow.tags(value) if value is not None else NONE
        if isinstance(target, ast.Name):
            self.env[target.id] = tags
        elif isinstance(target, (ast.Tuple, ast.List)):
            self._bind_each(target, value, stmt)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, None, stmt)
        elif isinstance(target, ast.Attribute):
            self.visit(target.value)
            self.flow.record_attribute(target, tags)
        elif isinstance(target, ast.Subscript):
            self.visit(target.value)
            self.visit(target.slice)
            self._bind_item(target, value, stmt)

    def _bind_each(
        self, target: ast.Tuple | ast.List, value: ast.expr | None, stmt: Located | None
    ) -> None:
        values = value.elts if isinstance(value, (ast.Tuple, ast.List)) else []
        same_shape = len(values) == len(target.elts) and not any(
            isinstance(e, ast.Starred) for e in [*values, *target.elts]
        )
        for i, elt in enumerate(target.elts):
            self.bind(elt, values[i] if same_shape else None, stmt)

    def _bind_item(
        self, target: ast.Subscript, value: ast.expr | None, stmt: Located | None
    ) -> None:
        """`scores[mask] = float("-inf")` makes `scores` a -inf fill."""
        base = target.value
        if stmt is None or not isinstance(base, ast.Name):
            return
        if self.flow.const(value) == float("-inf"):
            self.env[base.id] = self.env.get(base.id, NONE) | {Tag(Kind.NEG_INF, stmt)}
