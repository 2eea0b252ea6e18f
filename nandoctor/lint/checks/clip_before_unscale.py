"""clip-before-unscale: `clip_grad_norm_` on gradients the GradScaler still scales.

In a function that runs `scaler.scale(loss).backward()` (or, in one that only steps,
before its `scaler.step(opt)`), torch's `clip_grad_norm_` / `clip_grad_value_` (or a
helper of this file that calls them) must come after `scaler.unscale_(opt)`. Not flagged:
an `unscale_` earlier in the function, a clip on the other branch of `if use_amp: ...
else: ...` (or of a second `if` on the same test), a clip in a function without a scaler,
and `accelerator.clip_grad_norm_` (Accelerate unscales for you).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity
from nandoctor.lint.registry import Hit, check
from nandoctor.lint.scaler import (
    ScalerUse,
    clip_helpers,
    helper_called,
    scaled_before,
    scaler_uses,
    unscaled_before,
)
from nandoctor.lint.source import Source

INVALID = (
    """\
import torch
scaler.scale(loss).backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(opt)
scaler.update()
""",
    """\
from torch.nn.utils import clip_grad_value_
def train_step(model, opt, scaler, loss):
    scaler.scale(loss).backward()
    clip_grad_value_(model.parameters(), 0.5)
    scaler.step(opt)
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
if scaler is not None:
    scaler.scale(loss).backward()
    scaler.step(opt)
else:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # no scaler on this path
    opt.step()
""",
    """\
import torch
accelerator.backward(loss)
accelerator.clip_grad_norm_(model.parameters(), 1.0)  # Accelerate unscales first
""",
    """\
import torch
if args.amp:
    scaler.scale(loss).backward()
else:
    loss.backward()
if args.amp:  # the same flag: the float32 branch below never saw a scaled gradient
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
else:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
""",
)


@check(
    "clip-before-unscale",
    severity=Severity.ERROR,
    summary="Gradient clipping after `scaler.scale(loss).backward()` without "
    "`scaler.unscale_(opt)` before it.",
    invalid=INVALID,
    valid=VALID,
)
def clip_before_unscale(src: Source) -> Iterator[Hit]:
    helpers = clip_helpers(src)
    for use in scaler_uses(src):
        for call in src.calls_by_function[use.scope]:
            what = _clip_name(src, call, helpers)
            if what and scaled_before(src, use, call) and not unscaled_before(src, use, call):
                yield Hit(call, _message(what, use))


def _clip_name(src: Source, call: ast.Call, helpers: dict[str, ast.AST]) -> str | None:
    if patterns.is_clip(src, call):
        return (src.qualname(call.func) or "clip_grad_norm_").rsplit(".", 1)[-1]
    helper = helper_called(src, call, helpers)
    return f"{helper}() (it calls clip_grad_norm_)" if helper else None


def _message(what: str, use: ScalerUse) -> str:
    scaler = ast.unparse((use.scales or use.steps)[0].func.value)  # type: ignore[attr-defined]
    opt = ast.unparse(use.steps[0].args[0]) if use.steps and use.steps[0].args else "optimizer"
    return (
        f"Call `{scaler}.unscale_({opt})` before `{what}`: the gradients are still multiplied "
        f"by the loss scale (65536 at the start), so the clip threshold is applied to the "
        f"scaled norm and the real update shrinks by that factor."
    )
