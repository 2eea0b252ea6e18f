"""learning-rate-too-high: updates too large for the weights; the loss diverged first (or with
the gradients), or the last update moved the weights by a large fraction of their norm.

The what-if replays the run with a learning rate 10x smaller.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import num

ID = "learning-rate-too-high"

INFO = entry(
    ID,
    title="updates too large for the weights",
    explanation="""
    When each update is a sizeable fraction of the weight it changes (an update-to-weight
    ratio above ~1e-2 per step, where ~1e-3 is healthy), the loss climbs instead of falling,
    weights and activations grow, and the first op that leaves the dtype's range produces
    inf. The failing step is only where the divergence became visible: the loss curve rises
    tens or hundreds of steps before it.
    """,
    fix="""
    Lower the learning rate (10x smaller is a good first test) or warm it up over the first
    steps: smaller updates keep the update-to-weight ratio near 1e-3, where training
    converges instead of diverging.
    """,
    before="""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    """,
    after="""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=1000)
    """,
)


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


FIXES = (Fix(change=Change.SMALLER_LR),)

CAUSE = CauseUnit(INFO, rule=learning_rate_too_high, fixes=FIXES)
