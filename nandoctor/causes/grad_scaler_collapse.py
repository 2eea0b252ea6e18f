"""grad-scaler-collapse: a streak of overflow skips drove the GradScaler's loss scale toward 0.

The facts carry the streak (`collapsed`, and the sentence that says so); an overflow in
backward at that scale makes it likelier that the gradients truly exceed float16.
Nothing to replay: the collapse is a symptom of what makes every step non-finite.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import CauseUnit, Hit, entry
from nandoctor.causes.words import OVERFLOWED, where

ID = "grad-scaler-collapse"

INFO = entry(
    ID,
    title="repeated overflow skips drove the loss scale toward 0",
    explanation="""
    GradScaler multiplies the loss by a scale (65536 at the start) so that small float16
    gradients do not underflow; on a step whose scaled gradients hold inf or NaN it skips
    the update and halves the scale. A few skips are normal; a streak means the gradients
    are non-finite at any scale (a NaN from the forward pass, or a real overflow): after 16
    skips the scale is 1, after 40 it is below 1e-7 and every gradient underflows to 0.
    """,
    fix="""
    Fix what makes every step non-finite (`nandoctor diagnose` names the first op) instead
    of tuning the scaler, and switch to bfloat16 if the gradients truly overflow: skipping
    steps cannot repair a NaN that the forward pass produces every time.
    """,
    before="""
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0**16)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    """,
    after="""
    with torch.autocast("cuda", dtype=torch.bfloat16):  # no loss scale to collapse
        loss = model(x, y)
    loss.backward()
    opt.step()
    """,
)


def grad_scaler_collapse(case: Case) -> Hit | None:
    if not case.facts.collapsed:
        return None
    evidence = [case.facts.collapse_why]
    overflow = case.first.value in OVERFLOWED and case.first.phase == "backward"
    if overflow:
        evidence.append(
            f"even at that scale, {case.first.op}{where(case)} overflowed float16 in backward: "
            "the unscaled gradients exceed 65504"
        )
    return Hit(0.88 if overflow else 0.6, evidence)


CAUSE = CauseUnit(INFO, rule=grad_scaler_collapse)
