"""Where a function drives a GradScaler: its `scale(loss).backward()`, `unscale_` and
`step` calls, shared by the clip-before-unscale and exploding-gradients checks.

A `.scale(x)` call counts when its result is backpropagated (`scaler.scale(loss).backward()`)
or when its receiver is named like a scaler (`self.grad_scaler.scale(loss)`), so a
GradScaler passed in as a parameter is found as well as one built in the same function.
Accelerate, Lightning, DeepSpeed and timm's `NativeScaler` scale inside the library: no
`.scale(...)` in user code, nothing to check.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from nandoctor.lint import patterns
from nandoctor.lint.source import Source, position


@dataclass(frozen=True)
class ScalerUse:
    scope: ast.AST  # the function (or module) that drives the scaler
    scales: tuple[ast.Call, ...]  # `scaler.scale(loss)`, backpropagated
    unscales: tuple[ast.Call, ...]  # `scaler.unscale_(opt)`
    steps: tuple[ast.Call, ...]  # `scaler.step(opt)`


def scaler_uses(src: Source) -> list[ScalerUse]:
    """One entry per function (or module body) that calls `scaler.scale(loss)` or
    `scaler.step(opt)` (a training class may backpropagate in one method, step in another)."""
    return src.analysis(_find_uses)


def _find_uses(src: Source) -> list[ScalerUse]:
    uses = []
    for scope, calls in src.calls_by_function.items():
        scales = tuple(c for c in calls if is_scale(src, c))
        receivers = {ast.dump(receiver) for c in scales if (receiver := _receiver(c)) is not None}
        steps = tuple(c for c in calls if _is_step(c, receivers))
        if scales or steps:
            unscales = tuple(c for c in calls if _method(c) == "unscale_")
            uses.append(ScalerUse(scope, scales, unscales, steps))
    return uses


def _is_step(call: ast.Call, scale_receivers: set[str]) -> bool:
    """`scaler.step(opt)`: on a receiver that scaled a loss here, or named like a scaler."""
    receiver = _receiver(call)
    if receiver is None or _method(call) != "step" or len(call.args) != 1:
        return False
    return ast.dump(receiver) in scale_receivers or "scaler" in _last_name(receiver).lower()


def _last_name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def is_scale(src: Source, call: ast.Call) -> bool:
    receiver = _receiver(call)
    if receiver is None or _method(call) != "scale" or len(call.args) != 1 or call.keywords:
        return False
    if src.qualname(receiver) is not None:
        return False  # a module's function called `scale`, not a GradScaler
    parent = src.parents.get(call, (None, ""))[0]
    if isinstance(parent, ast.Attribute) and parent.attr == "backward":
        return True
    return "scaler" in _last_name(receiver).lower()


def unscaled_before(src: Source, use: ScalerUse, node: ast.AST) -> bool:
    """An `unscale_` runs before `node` on some path that reaches it, after the last
    `scale(loss).backward()` before `node`: a GAN's `unscale_(opt_d)` unscales the
    discriminator's gradients, not the generator's that a second backward scales later."""
    reaching = [s for s in use.scales if _before(s, node) and not src.exclusive(s, node)]
    last = max(reaching, key=position, default=None)
    return any(
        _before(u, node) and not src.exclusive(u, node) and (last is None or _before(last, u))
        for u in use.unscales
    )


def scaled_before(src: Source, use: ScalerUse, node: ast.AST) -> bool:
    """The gradients are scaled when `node` runs: a `scale(loss).backward()` before it on a
    path that reaches it (not the other branch of `if use_amp: ... else: ...`), or, in a
    function that only steps, a `scaler.step(opt)` after it."""
    if use.scales:
        return any(_before(s, node) and not src.exclusive(s, node) for s in use.scales)
    return any(_before(node, s) and not src.exclusive(s, node) for s in use.steps)


def clip_helpers(src: Source) -> dict[str, ast.AST]:
    """Functions of this file that clip gradients themselves and never unscale: calling
    one between backward and step clips scaled gradients just the same."""
    helpers: dict[str, ast.AST] = {}
    for scope, calls in src.calls_by_function.items():
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            clips = any(patterns.is_clip(src, c) for c in calls)
            if clips and not any(_method(c) == "unscale_" for c in calls):
                helpers[scope.name] = scope
    return helpers


def helper_called(src: Source, call: ast.Call, helpers: dict[str, ast.AST]) -> str | None:
    """The name of the clip helper that `call` calls (`clip(model)`, `self.clip()`)."""
    func = call.func
    if isinstance(func, ast.Name) and func.id in helpers and src.qualname(func) is None:
        return func.id
    if isinstance(func, ast.Attribute) and getattr(func.value, "id", "") in ("self", "cls"):
        return func.attr if func.attr in helpers else None
    return None


def scaler_name(call: ast.Call) -> str:
    """How the code names the scaler of a use's `scale` or `step` call: `scaler`,
    `self.grad_scaler` (what the finding tells to call `unscale_` on)."""
    receiver = _receiver(call)
    return ast.unparse(receiver) if receiver is not None else "scaler"


def _receiver(call: ast.Call) -> ast.expr | None:
    """`x` for a method call `x.name(...)`, None for a plain call `name(...)`."""
    return call.func.value if isinstance(call.func, ast.Attribute) else None


def _method(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _before(a: ast.AST, b: ast.AST) -> bool:
    return position(a) < position(b)
