"""Causes in the training dynamics, read from the telemetry: gradients that ran away, a
loss that diverged, a loss scale that collapsed."""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.rules.registry import Hit, num, rule, where


@rule("exploding-gradients")
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
    else:
        confidence *= 0.5
    return Hit(confidence, evidence)


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
    if t.loss_onset is None and (t.loss_late_slope or 0) <= 0 and (t.loss_rise or 1) < 1.3:
        evidence.append("though the loss kept improving: the gradients grew with the model's scale")
        return 0.35
    if led:
        evidence.append(f"the gradients ran away from step {t.grad_onset}")
        return 0.6
    return 0.5


def _gradient_overflow(case: Case) -> bool:
    overflow = case.first.value in ("inf", "-inf", "mixed")
    return case.first.phase == "backward" and overflow and not case.facts.collapsed


@rule("learning-rate-too-high")
def learning_rate_too_high(case: Case) -> Hit | None:
    """The loss diverged first (or with the gradients), or the updates were far too large."""
    t, update = case.trends, case.evidence.update
    evidence, confidence = [], 0.0
    if t.loss_onset is not None and (t.grad_onset is None or t.loss_onset <= t.grad_onset):
        evidence.append(
            f"the loss diverged from step {t.loss_onset}: from its best {num(t.loss_min)} "
            f"(step {t.loss_min_step}) up to {num(t.loss_last)}, before or with the gradients"
        )
        confidence = 0.85
    elif (t.loss_rise or 0) >= 2 and (t.loss_late_slope or 0) > 0:
        evidence.append(
            f"the loss climbed from its best {num(t.loss_min)} (step {t.loss_min_step}) back "
            f"up to {num(t.loss_last)} before the failure"
        )
        confidence = 0.5
    if update is not None and update.ratio >= 0.03:
        evidence.append(
            f"step {update.step}, the last update before the failure, moved the weights by "
            f"{update.ratio:.1%} of their norm ({update.largest:.1%} for "
            f"{update.largest_param}); about 0.1% is typical"
        )
        confidence = (
            min(0.95, confidence + 0.1) if confidence else (0.5 if update.ratio >= 0.1 else 0.35)
        )
    if not evidence:
        return None
    lr = f" (lr={case.facts.lr:g})" if case.facts.lr else ""
    return Hit(confidence, [*evidence, f"the optimizer is {case.facts.optimizer}{lr}"])


@rule("grad-scaler-collapse")
def grad_scaler_collapse(case: Case) -> Hit | None:
    if not case.facts.collapsed:
        return None
    evidence = [case.facts.collapse_why]
    overflow = case.first.value in ("inf", "-inf", "mixed") and case.first.phase == "backward"
    if overflow:
        evidence.append(
            f"even at that scale, {case.first.op}{where(case)} overflowed float16 in backward: "
            "the unscaled gradients exceed 65504"
        )
    return Hit(0.88 if overflow else 0.6, evidence)
