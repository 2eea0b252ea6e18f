"""One walk over a file's syntax tree that every later question reuses.

For each node: its parent (and the parent's field holding it) and its innermost scope
(module, class body, function or lambda); for each scope: the names it binds itself
(parameters, assignment and loop targets, `def`/`class` names, `except ... as e`), minus
those declared `global`/`nonlocal`. Nodes come in pre-order, so an outer function is seen
before the functions inside it and methods in source order.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TypeAlias

SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
# A node with a place in the file, where a finding can point (`ast.AST` itself has none: an
# `ast.arguments`, an operator); a check's `Spot` and the data flow's `Tag` hold one.
Located: TypeAlias = ast.expr | ast.stmt
# What a name is evaluated in (one of SCOPES).
Scope: TypeAlias = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
# NB: these fields of a def or class are evaluated in the enclosing scope.
_OUTER_FIELDS = frozenset({"decorator_list", "returns", "bases", "keywords"})
_SCOPE_TYPES = frozenset(SCOPES)
_BINDERS = _SCOPE_TYPES | {ast.Name, ast.ExceptHandler, ast.Global, ast.Nonlocal}


@dataclass(frozen=True)
class Index:
    nodes: list[ast.AST]
    parents: dict[ast.AST, tuple[ast.AST, str]]
    scopes: dict[ast.AST, ast.AST]  # node -> the scope it is evaluated in
    bindings: dict[ast.AST, frozenset[str]]


def build_index(tree: ast.Module) -> Index:
    nodes: list[ast.AST] = []
    parents: dict[ast.AST, tuple[ast.AST, str]] = {}
    scopes: dict[ast.AST, ast.AST] = {}
    bound: dict[ast.AST, set[str]] = {tree: set()}
    declared: dict[ast.AST, set[str]] = {}
    stack: list[tuple[ast.AST, ast.AST]] = [(tree, tree)]
    while stack:
        node, scope = stack.pop()
        nodes.append(node)
        scopes[node] = scope
        kind = type(node)
        if kind in _BINDERS and node is not tree:
            _bind(node, scope, bound, declared)
        inner = node if kind in _SCOPE_TYPES else scope
        children = []
        for field in node._fields:  # NB: not ast.iter_fields: this loop is the hot spot
            value = getattr(node, field, None)
            child_scope = scope if field in _OUTER_FIELDS else inner
            if type(value) is list:
                for child in value:
                    if isinstance(child, ast.AST):
                        parents[child] = (node, field)
                        children.append((child, child_scope))
            elif isinstance(value, ast.AST):
                parents[value] = (node, field)
                children.append((value, child_scope))
        stack.extend(reversed(children))
    bindings = {s: frozenset(names - declared.get(s, set())) for s, names in bound.items()}
    return Index(nodes, parents, scopes, bindings)


def _bind(node: ast.AST, scope: ast.AST, bound: dict, declared: dict) -> None:
    if isinstance(node, SCOPES):
        if not isinstance(node, ast.Lambda):
            bound[scope].add(getattr(node, "name", ""))  # def and class, never the module
        bound[node] = _parameters(node)
    elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
        bound[scope].add(node.id)
    elif isinstance(node, ast.ExceptHandler) and node.name:
        bound[scope].add(node.name)
    elif isinstance(node, (ast.Global, ast.Nonlocal)):
        declared.setdefault(scope, set()).update(node.names)


def _parameters(scope: ast.AST) -> set[str]:
    if not isinstance(scope, FUNCTIONS):
        return set()
    args = scope.args
    every = (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg)
    return {a.arg for a in every if a is not None}
