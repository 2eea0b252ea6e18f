"""clip-before-unscale: gradients clipped while the GradScaler still scales them.

`nandoctor lint` finds it in the source, where the order of the calls shows; at run time
only the hooks see that order (`watch`, `Guard`: a loop nandoctor did not write, whose
`clip_grad_norm_` met gradients that carried the loss scale: `RunFacts.clipped_scaled`).
`diagnose` always unscales before it clips, so its replay never meets it, and there is no
fix to replay: the order is the user's code.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import CauseUnit, Hit, entry

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


def clip_before_unscale(case: Case) -> Hit | None:
    """The loop clipped scaled gradients: every update was up to the loss scale smaller
    than meant, which a learning rate raised to make up for it turns into a divergence.
    Above a trend's weight (a raised rate is its symptom), below a mechanism seen."""
    step = case.facts.clipped_scaled
    if step is None:
        return None
    evidence = [
        f"from step {step} the loop clipped the gradients before `scaler.unscale_`: the "
        "threshold met their norm times the loss scale, so the clip shrank every update "
        "by up to that factor"
    ]
    return Hit(0.6, evidence)


CAUSE = CauseUnit(INFO, rule=clip_before_unscale)
