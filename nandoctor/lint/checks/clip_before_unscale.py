"""clip-before-unscale: `clip_grad_norm_` on gradients the GradScaler still scales.

In a function that runs `scaler.scale(loss).backward()` (or, in one that only steps,
before its `scaler.step(opt)`), torch's `clip_grad_norm_` / `clip_grad_value_` (or a
helper of this file that calls them, or FSDP's `model.clip_grad_norm_(max_norm)`) must
come after `scaler.unscale_(opt)`, and after the last scaled backward before it: with two
models and one scaler (a GAN), `unscale_(opt_d)` leaves the generator's gradients scaled.
Not flagged: an `unscale_` between the backward and the clip, a clip on the other branch
of `if use_amp: ... else: ...` (or of a second `if` on the same test), a clip in a function
without a scaler, and `accelerator.clip_grad_norm_(params, max_norm)` (Accelerate unscales
for you).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity
from nandoctor.lint.scaler import (
    ScalerUse,
    clip_helpers,
    helper_called,
    scaled_before,
    scaler_name,
    scaler_uses,
    unscaled_before,
)
from nandoctor.lint.source import Source, position
from nandoctor.lint.unit import Check, Spot

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
    """\
import torch
scaler.scale(d_loss).backward()
scaler.unscale_(opt_d)
torch.nn.utils.clip_grad_norm_(D.parameters(), 10.0)
scaler.step(opt_d)
scaler.scale(g_loss).backward()
torch.nn.utils.clip_grad_norm_(G.parameters(), 10.0)  # opt_g was never unscaled
scaler.step(opt_g)
scaler.update()
""",
    """\
import torch
scaler.scale(loss).backward()
model.clip_grad_norm_(1.0)  # FSDP's own clip: the gradients are still scaled
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


def clip_before_unscale(src: Source) -> Iterator[Spot]:
    helpers = clip_helpers(src)
    for use in scaler_uses(src):
        for call in src.calls_by_function[use.scope]:
            what = _clip_name(src, call, helpers)
            if what and scaled_before(src, use, call) and not unscaled_before(src, use, call):
                yield Spot(call, _message(what, use, call))


def _clip_name(src: Source, call: ast.Call, helpers: dict[str, ast.AST]) -> str | None:
    if patterns.is_clip(src, call):
        return (src.qualname(call.func) or "clip_grad_norm_").rsplit(".", 1)[-1]
    if _model_clip(src, call):
        return ast.unparse(call.func)
    helper = helper_called(src, call, helpers)
    return f"{helper}() (it calls clip_grad_norm_)" if helper else None


def _model_clip(src: Source, call: ast.Call) -> bool:
    """FSDP's `model.clip_grad_norm_(max_norm)`: torch's clip, over the model's shards.
    NB: Accelerate's takes the parameters first (`accelerator.clip_grad_norm_(params,
    max_norm)`) and unscales; one argument (or `max_norm=` alone) is the model's."""
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr != "clip_grad_norm_":
        return False
    if src.qualname(func) is not None or "accelerat" in ast.unparse(func.value).lower():
        return False
    keywords = {k.arg for k in call.keywords}
    return len(call.args) + len(keywords - {"norm_type", "error_if_nonfinite"}) == 1


def _message(what: str, use: ScalerUse, clip: ast.Call) -> str:
    scaler = scaler_name((use.scales or use.steps)[0])
    # NB: the optimizer the next `scaler.step` steps (a GAN's second one, after its clip)
    step = next((s for s in use.steps if position(s) > position(clip)), None)
    step = step or (use.steps[0] if use.steps else None)
    opt = ast.unparse(step.args[0]) if step is not None and step.args else "optimizer"
    return (
        f"Call `{scaler}.unscale_({opt})` before `{what}`: the gradients are still multiplied "
        f"by the loss scale (65536 at the start), so the clip threshold is applied to the "
        f"scaled norm and the real update shrinks by that factor."
    )


CHECK = Check(
    id="clip-before-unscale",
    run=clip_before_unscale,
    severity=Severity.ERROR,
    summary="Gradient clipping after `scaler.scale(loss).backward()` without "
    "`scaler.unscale_(opt)` before it.",
    invalid=INVALID,
    valid=VALID,
)
