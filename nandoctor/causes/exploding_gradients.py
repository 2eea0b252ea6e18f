"""exploding-gradients: gradients that grew far beyond their usual size, ahead of the loss.

Read from the telemetry: the gradient norm's growth, which diverged first (the gradients
or the loss, which tells this cause from learning-rate-too-high), skipped scaler steps and
whether clipping is on. The what-if replays the run with `unscale_` then
`clip_grad_norm_(1.0)`; for gradients that overflowed inside the backward, where no clip
can act, with a 10x smaller learning rate, then with bfloat16.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import OVERFLOWED, num, where

ID = "exploding-gradients"
CLIP_FIX = 1.0  # the max_norm the fix clips to (`Change.CLIP_GRAD_NORM`)

INFO = entry(
    ID,
    title="gradient norm grew until it overflowed",
    explanation="""
    Without clipping, one bad batch or a sharp region of the loss multiplies the gradient
    norm step after step; once a gradient passes 65504 in float16 (3.4e38 in float32) it is
    inf, and the update writes NaN into the weights. With a GradScaler the gradients are
    still multiplied by the loss scale (65536 at the start) until `scaler.unscale_(opt)`, so
    the clipping must come after it to compare the threshold with the true norm.
    """,
    fix="""
    Clip the gradient norm every step, after `scaler.unscale_(opt)` when a GradScaler is
    used (`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`): the clip bounds each
    update however large one batch's gradient is.
    """,
    before="""
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    """,
    after="""
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # gradients back to their true size
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(opt)  # still skips the step if the gradients hold inf or NaN
    scaler.update()
    """,
)


def exploding_gradients(case: Case) -> Hit | None:
    """Gradients that grew far beyond their usual size, ahead of the loss."""
    t, clip = case.trends, case.facts.clip_grad_norm
    evidence, confidence = [], 0.0
    if (t.grad_growth or 0) >= 5:
        evidence.append(
            f"the gradient norm grew {t.grad_growth:.3g}x, from {num(t.grad_early)} early on "
            f"to {num(t.grad_late)} just before the failure"
        )
        confidence = _gradients_led(case, evidence)
    if _gradient_overflow(case):
        evidence.append(
            f"the gradients themselves overflowed in backward ({case.first.op}{where(case)})"
        )
        confidence = max(confidence, 0.6)
    if not evidence:
        return None
    if t.late_skips >= 3:
        evidence.append(
            f"the GradScaler skipped {t.late_skips} steps for overflowing gradients after "
            "its first calibration"
        )
        confidence = max(confidence, 0.45)
    if clip is None:
        evidence.append("no gradient clipping is configured")
        return Hit(confidence, evidence)
    return _clipped(case, clip, confidence, evidence)


def _clipped(case: Case, clip: float, confidence: float, evidence: list[str]) -> Hit | None:
    """The loop clips already: each update was bounded, so grown gradients alone did not
    break it, and the catalog's fix (clip at 1.0) would change nothing at 1.0 or below.
    What is left: a looser clip to tighten, or gradients that overflowed inside the
    backward, before any clip could act."""
    overflowed = _gradient_overflow(case)
    if clip <= CLIP_FIX and not overflowed:
        return None
    evidence.append(f"the loop clips the gradient norm at {clip:g}")
    if overflowed:
        fix = (
            f"Clipping (at {clip:g}) acts after the backward and cannot stop gradients "
            "overflowing inside it: keep them bounded at their source, with a lower or "
            "warmed-up learning rate, or bfloat16 (float32's range) instead of float16."
        )
        return Hit(confidence * 0.5, evidence, fix=fix)
    fix = (
        f"Clip tighter: `torch.nn.utils.clip_grad_norm_(model.parameters(), {CLIP_FIX})` "
        f"rather than {clip:g}, after `scaler.unscale_(opt)` when a GradScaler is used."
    )
    return Hit(confidence * 0.5, evidence, fix=fix)


def _gradients_led(case: Case, evidence: list[str]) -> float:
    """Confidence from which diverged first: the gradients (exploding) or the loss (lr)."""
    t = case.trends
    led = t.grad_onset is not None and (t.loss_onset is None or t.grad_onset < t.loss_onset)
    if led and t.loss_onset is not None:
        evidence.append(
            f"the gradients ran away first, from step {t.grad_onset}; the loss only from "
            f"step {t.loss_onset}"
        )
        return 0.85
    improving = (t.loss_late_slope or 0) <= 0 and (t.loss_rise or 1) < 1.3 and not t.loss_rose
    if t.loss_onset is None and improving:
        evidence.append("though the loss kept improving: the gradients grew with the model's scale")
        return 0.35
    if led:
        evidence.append(f"the gradients ran away from step {t.grad_onset}")
        return 0.6
    return 0.5


def _gradient_overflow(case: Case) -> bool:
    """An overflow in the backward, after steps the gradients could have grown over: at
    the run's first step nothing grew (huge at once: the inputs or the formula)."""
    overflow = case.first.value in OVERFLOWED and not _divided_by_zero(case)
    grown = case.first.step > case.facts.start_step
    return case.first.phase == "backward" and overflow and grown and case.collapse is None


def _divided_by_zero(case: Case) -> bool:
    """An inf made by dividing by an exact 0 (the backward of sqrt at 0 divides by
    2 sqrt(0)) is no overflow: no value grew, whatever the gradients' size."""
    divisor = case.divisor
    return divisor is not None and divisor.zeros > 0


# NB: clipping acts after the backward: gradients that overflow inside it (its phase) are
# kept bounded at their source, by a smaller rate or by float32's range
_INSIDE_THE_BACKWARD = frozenset({"backward"})
FIXES = (
    Fix(change=Change.CLIP_GRAD_NORM),
    Fix(change=Change.SMALLER_LR, phases=_INSIDE_THE_BACKWARD),
    Fix(change=Change.BFLOAT16, phases=_INSIDE_THE_BACKWARD),
)

CAUSE = CauseUnit(INFO, rule=exploding_gradients, fixes=FIXES)
