"""exploding-gradients: a GradScaler loop that never clips the gradients.

Lower severity than clip-before-unscale: many runs train fine unclipped, but nothing bounds
an update when one batch's gradient blows up. Judged per training loop: each
`scaler.step(opt)` belongs to its innermost `for`/`while` loop (else its function, else
the module), and that loop is clipped when it calls anything named like `clip` (by its
name here or the name it was imported under: `clip_grad_norm_ as cgn`), or passes a
`clip...=` keyword (`loss_scaler(..., clip_grad=1.0)`), or calls a function of this file
that does. A gradient hook (`register_hook`) anywhere bounds every loop. One finding per
unclipped loop, at its first `scaler.step(opt)`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from nandoctor.lint.findings import Severity
from nandoctor.lint.scaler import scaler_name, scaler_uses
from nandoctor.lint.source import Source, position
from nandoctor.lint.unit import Check, Spot

INVALID = (
    """\
import torch
scaler = torch.cuda.amp.GradScaler()
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
""",
)

VALID = (
    """\
import torch
scaler.scale(loss).backward()
scaler.unscale_(opt)
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(opt)
scaler.update()
""",
    """\
import torch
loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())  # timm
""",
)


def exploding_gradients(src: Source) -> Iterator[Spot]:
    uses = scaler_uses(src)
    if not uses or any(_name(c) == "register_hook" for c in src.calls):
        return
    steps = [s for use in uses for s in use.steps]
    anchors = steps or [s for use in uses for s in use.scales]
    loops: dict[ast.AST, list[ast.Call]] = {}
    for anchor in sorted(anchors, key=position):
        loops.setdefault(_loop_of(src, anchor), []).append(anchor)
    clipping = _clipping_functions(src)
    for loop, calls in loops.items():
        if not _clips_in(src, loop, clipping):
            yield Spot(calls[0], _message(calls[0]))  # NB: one finding per unclipped loop


def _loop_of(src: Source, node: ast.AST) -> ast.AST:
    """The innermost loop around `node` inside its function; else the function or module."""
    scope = src.function_of(node) or src.tree
    for parent in src.ancestors(node):
        if parent is scope:
            return scope
        if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)):
            return parent
    return scope


def _clipping_functions(src: Source) -> frozenset[str]:
    """Names of the file's functions whose body clips (one level: a helper `clip_and_step`
    or `apply_update` that calls `clip_grad_norm_`)."""
    defs = src.nodes_of(ast.FunctionDef, ast.AsyncFunctionDef)
    return frozenset(d.name for d in defs if _clips_in(src, d, frozenset()))


def _clips_in(src: Source, container: ast.AST, clipping: frozenset[str]) -> bool:
    for call in ast.walk(container):
        if not isinstance(call, ast.Call):
            continue
        name = _name(call)
        imported = (src.qualname(call.func) or "").rpartition(".")[2]
        if "clip" in name.lower() or "clip" in imported.lower() or name in clipping:
            return True
        if any(k.arg and "clip" in k.arg.lower() for k in call.keywords):
            return True
    return False


def _name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _message(anchor: ast.Call) -> str:
    scaler = scaler_name(anchor)
    is_step = isinstance(anchor.func, ast.Attribute) and anchor.func.attr == "step"
    opt = ast.unparse(anchor.args[0]) if is_step and anchor.args else "opt"
    return (
        f"Clip the gradients: call `{scaler}.unscale_({opt})` and "
        f"`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before "
        f"`{scaler}.step({opt})`, or one bad batch can grow them until they overflow "
        f"(65504 in float16)."
    )


CHECK = Check(
    id="exploding-gradients",
    run=exploding_gradients,
    severity=Severity.WARNING,
    summary="A GradScaler loop (`scaler.scale(loss).backward()`) that never clips the "
    "gradients (judged per training loop).",
    invalid=INVALID,
    valid=VALID,
)
