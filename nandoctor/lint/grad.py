"""Which code is differentiated: where a NaN *gradient* can come from.

Seeds: functions that call `.backward()` or `torch.autograd.grad`, functions named like
a forward pass, a loss or a training step (`forward`, `compute_loss`, `training_step`),
and top-level code that calls `.backward()`. Then everything those call by name in the same
file (`pairwise_distance(a, b)`, `self._attend(q, k)`), to a fixed point. An optimizer's
`step` is not a seed (it runs under `no_grad`), nor is a module's `get_attention_map`
that only a notebook calls. Code under
`torch.no_grad()` is never differentiated. Data loading, metrics and plotting are left
out, which is what keeps the heuristic checks quiet there.

`call_chain` answers the neighbouring question of which code runs together with a function:
its callers and everything they call (an optimizer step in the loop that calls it).
"""

from __future__ import annotations

import ast
import re

from nandoctor.lint import patterns
from nandoctor.lint.source import Source

# NB: matched against the words of a name (`compute_loss`, `training_step`, `nll_loss_fn`),
# so that `constraint` is not `train` and `lossless` is not a loss.
TRAINING_WORDS = frozenset({
    "forward", "loss", "losses", "criterion", "objective", "train", "training", "penalty",
    "regularizer", "regularization", "call",
})  # fmt: skip

Function = ast.FunctionDef | ast.AsyncFunctionDef


def on_differentiated_path(src: Source, node: ast.AST) -> bool:
    if patterns.in_no_grad(src, node):
        return False
    return (src.function_of(node) or src.tree) in differentiated(src)


def differentiated(src: Source) -> frozenset[ast.AST]:
    """The scopes (functions, and the module for top-level code) a gradient flows through."""
    return src.analysis(_differentiated)


def _differentiated(src: Source) -> frozenset[ast.AST]:
    return _reach(_callees(src), _seeds(src))


def _seeds(src: Source) -> set[ast.AST]:
    seeds: set[ast.AST] = set()
    for scope, calls in src.calls_by_function.items():
        if any(_is_backward(src, c) for c in calls):
            seeds.add(scope)
    for node in src.nodes_of(ast.FunctionDef, ast.AsyncFunctionDef):
        if _seed_function(src, node):
            seeds.add(node)
    return seeds


def _seed_function(src: Source, function: Function) -> bool:
    if any(patterns.is_no_grad(src, d) for d in function.decorator_list):
        return False
    return bool(TRAINING_WORDS & set(re.split(r"_+", function.name.lower())))


def _is_backward(src: Source, call: ast.Call) -> bool:
    if isinstance(call.func, ast.Attribute) and call.func.attr == "backward":
        return True
    return src.qualname(call.func) == "torch.autograd.grad"


def call_chain(src: Source, scope: ast.AST) -> frozenset[ast.AST]:
    """The scopes that run in one call chain with `scope`: the functions that call it,
    directly or not (a function nested in another counts as called by it: the `closure`
    handed to `optimizer.step(closure)`), and everything any of those calls. Two tests that
    share a helper are not in one chain: what one of them does says nothing of the other."""
    callers: dict[ast.AST, set[ast.AST]] = {}
    for caller, called in _callees(src).items():
        for function in called:
            callers.setdefault(function, set()).add(caller)
    for function in src.nodes_of(ast.FunctionDef, ast.AsyncFunctionDef):
        outer = src.function_of(function)
        if outer is not None:
            callers.setdefault(function, set()).add(outer)
    return _reach(_callees(src), set(_reach(callers, {scope})))


def _reach(edges: dict[ast.AST, set[ast.AST]], seeds: set[ast.AST]) -> frozenset[ast.AST]:
    done: set[ast.AST] = set()
    todo = list(seeds)
    while todo:
        scope = todo.pop()
        if scope not in done:
            done.add(scope)
            todo.extend(edges.get(scope, ()))
    return frozenset(done)


def _callees(src: Source) -> dict[ast.AST, set[ast.AST]]:
    """Each scope's calls, by name, to functions of this file (module code is a scope too)."""
    return src.analysis(_call_edges)


def _call_edges(src: Source) -> dict[ast.AST, set[ast.AST]]:
    functions = _functions_by_name(src)
    return {
        scope: {f for call in calls for f in functions.get(_called_name(src, call), [])}
        for scope, calls in src.calls_by_function.items()
    }


def _functions_by_name(src: Source) -> dict[str | None, list[ast.AST]]:
    found: dict[str | None, list[ast.AST]] = {}
    for node in src.nodes_of(ast.FunctionDef, ast.AsyncFunctionDef):
        found.setdefault(node.name, []).append(node)
    return found


def _called_name(src: Source, call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name) and src.qualname(func) is None:
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr if func.value.id in ("self", "cls") else None
    return None
