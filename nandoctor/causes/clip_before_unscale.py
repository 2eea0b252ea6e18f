"""clip-before-unscale: gradients clipped while the GradScaler still scales them.

Only `nandoctor lint` looks for it (in the source, where the order of the calls shows):
a replay sees clipped gradients, not the order that made them, so there is no rule and
no fix to replay.
"""

from __future__ import annotations

from nandoctor.causes.unit import CauseUnit, entry

ID = "clip-before-unscale"

INFO = entry(
    ID,
    title="gradients clipped while still scaled by the GradScaler",
    explanation="""
    Between `scaler.scale(loss).backward()` and `scaler.step(opt)` every gradient is
    multiplied by the loss scale (65536 at the start). `clip_grad_norm_(params, 1.0)` on
    them clips the scaled norm to 1.0, so after unscaling the update is ~65536 times
    smaller than intended, and the effective threshold changes every time the scale does.
    `scaler.unscale_(opt)` divides the gradients back first; `scaler.step` then does not
    divide them twice.
    """,
    fix="""
    Call `scaler.unscale_(opt)` right before `clip_grad_norm_`: the threshold then applies
    to the true gradients, and `scaler.step(opt)` still skips the step if they hold inf or
    NaN.
    """,
    before="""
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    """,
    after="""
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    """,
)


CAUSE = CauseUnit(INFO)
