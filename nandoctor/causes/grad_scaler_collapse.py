"""grad-scaler-collapse: a streak of overflow skips drove the GradScaler's loss scale toward 0.

The facts say the failure was a collapse; the sentence about the streak is written from
the telemetry (its skip events and the scale it shows), so it quotes the same numbers as
the report's curves. An overflow in backward at that scale makes it likelier that the
gradients truly exceed float16. The what-ifs follow the fix's two branches: guard the op
that went non-finite (an overflowing op runs in float32): if the streak was that op's
doing, the scale stops collapsing; if the gradients overflow float16 wherever they flow,
that is not enough, and bfloat16 (the catalog's other remedy) is replayed next.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import OVERFLOWED, plural, where

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
    if case.collapse is None:
        return None
    evidence = [_streak(case)]
    if case.collapse.unchecked:
        evidence.append(
            "its skips were not rechecked at loss scale 1 (no rerun of the loop did): a NaN "
            "the backward makes at any scale (the log of a softmax zero, sqrt at 0) collapses "
            "the scale as an overflow does; `guard.step(fn, batch)`, or `nandoctor watch` "
            "with its replay, rechecks each skip and names the first that was one"
        )
    overflow = case.first.value in OVERFLOWED and case.first.phase == "backward"
    if overflow:
        # NB: the replay ran at the scale the streak fell to, not at 1: its overflow says the
        # scaled gradients exceed 65504 there, not that the unscaled ones do
        evidence.append(
            f"even at the scale the streak fell to, {case.first.op}{where(case)} overflowed "
            "float16 in backward: the scaler kept halving a scale the gradients still exceeded"
        )
    return Hit(0.88 if overflow else 0.6, evidence)


def _streak(case: Case) -> str:
    """The streak in the telemetry's numbers; the sentinel's sentence when it has none."""
    t = case.trends
    if not t.final_streak:
        return case.collapse.why if case.collapse is not None else ""
    first, last = t.final_scales
    if t.final_streak == 1:  # NB: one skip, at a scale below which the scale collapsed
        at = f" at loss scale {last:g}" if last else ""
        return f"the GradScaler skipped step {t.final_streak_start}{at}"
    scale = f"; the loss scale went from {first:g} to {last:g}" if first and last else ""
    return (
        f"the GradScaler skipped {plural(t.final_streak, 'step')} in a row from step "
        f"{t.final_streak_start}{scale}"
    )


FIXES = (GUARD_ORIGIN, Fix(change=Change.BFLOAT16))

CAUSE = CauseUnit(INFO, rule=grad_scaler_collapse, fixes=FIXES)
