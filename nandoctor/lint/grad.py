"""Which code is differentiated: where a NaN *gradient* can come from.

Seeds: functions that call `.backward()` or `torch.autograd.grad`, functions named like
a forward pass, a loss or a training step (`forward`, `compute_loss`, `training_step`),
and top-level code that calls `.backward()`. Then everything those call by name in the same
file (`pairwise_distance(a, b)`, `self._attend(q, k)`), to a fixed point. An optimizer's
`step` is not a seed (it runs under `no_grad`), nor is a module's `get_attention_map`
that only a notebook calls. Code under
`torch.no_grad()` is never differentiated. Data loading, metrics and plotting are left
out, which is what keeps the heuristic checks quiet there.
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
    cache = src.__dict__.setdefault("_differentiated", {})
    if "set" not in cache:
        cache["set"] = _closure(src, _seeds(src))
    return cache["set"]


def _seeds(src: Source) -> set[ast.AST]:
    seeds: set[ast.AST] = set()
    for scope, calls in src.calls_by_function.items():
        if any(_is_backward(src, c) for c in calls):
            seeds.add(scope)
    for node in src.nodes_of(ast.FunctionDef, ast.AsyncFunctionDef):
        if _seed_function(src, node):  # type: ignore[arg-type]
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


def _closure(src: Source, seeds: set[ast.AST]) -> frozenset[ast.AST]:
    functions = _functions_by_name(src)
    done: set[ast.AST] = set()
    todo = list(seeds)
    while todo:
        scope = todo.pop()
        if scope in done:
            continue
        done.add(scope)
        for call in src.calls_by_function.get(scope, []):
            todo.extend(functions.get(_called_name(src, call), []))
    return frozenset(done)


def _functions_by_name(src: Source) -> dict[str | None, list[ast.AST]]:
    found: dict[str | None, list[ast.AST]] = {}
    for node in src.nodes_of(ast.FunctionDef, ast.AsyncFunctionDef):
        found.setdefault(node.name, []).append(node)  # type: ignore[attr-defined]
    return found


def _called_name(src: Source, call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name) and src.qualname(func) is None:
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr if func.value.id in ("self", "cls") else None
    return None
