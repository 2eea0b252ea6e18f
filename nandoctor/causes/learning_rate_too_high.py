"""learning-rate-too-high: updates too large for the weights; the loss diverged first (or with
the gradients) for more than a few steps, a scheduler multiplied the rate just before the
failure, or the last update moved the weights by a large fraction of their norm.

The evidence and the fix quote the learning rate *in effect* at the failing step (a
scheduler's, not the config's), and the scheduler's jump that produced it. The what-if
replays the run with a learning rate 10x smaller (the config's, so every scheduled rate
is 10x smaller too).
"""

from __future__ import annotations

import math

from nandoctor.causes.case import Case, LrJump
from nandoctor.causes.unit import CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import num, plural
from nandoctor.report.evidence import UpdateRatio

ID = "learning-rate-too-high"

INFO = entry(
    ID,
    title="updates too large for the weights",
    explanation="""
    When each update is a sizeable fraction of the weight it changes (an update-to-weight
    ratio of a few per cent per step, where ~1e-3 is healthy; nandoctor counts a last update
    of 3% or more as evidence, as Adam's first steps on small weights can reach 1-2%, but
    not on its own for a batch that arrived non-finite or weights changed between steps,
    which no update made), the loss climbs instead of falling,
    weights and activations grow, and the first op that leaves the dtype's range produces
    inf. The failing step is only where the divergence became visible: the loss curve rises
    tens or hundreds of steps before it.
    """,
    fix="""
    Lower the learning rate in effect when it diverged (10x smaller is a good first test;
    with a scheduler, the rate it had reached, not the config's) or warm it up over the
    first steps: smaller updates keep the update-to-weight ratio near 1e-3, where training
    converges instead of diverging. A report quotes the rate in effect and the 10x smaller
    one.
    """,
    before="""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr)  # the rate that diverged
    """,
    after="""
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr / 10)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=1000)
    """,
)


JUMP = 10.0  # a scheduler that multiplied the rate this much in one step...
RECENT = 50  # ...within this many steps before the failure is evidence on its own
LARGE_UPDATE = 0.03  # a last update that moved the weights by this share of their norm


def learning_rate_too_high(case: Case) -> Hit | None:
    """The loss diverged first (or with the gradients) for several steps, the rate jumped
    just before the failure, or the updates were far too large."""
    evidence: list[str] = []
    confidence = _loss_rise(case, evidence)
    if (jump := _recent_jump(case)) is not None:
        evidence.append(
            f"{_scheduler(case)} multiplied the learning rate {jump.factor:.3g}x at step "
            f"{jump.step}, from {jump.before:g} to {jump.after:g}, "
            f"{plural(case.first.step - jump.step, 'step')} before the failure"
        )
        confidence = max(confidence, 0.8)
    update = case.evidence.update
    # NB: a batch that arrived non-finite, or weights changed between steps, are not the
    # last update's doing: its size alone is then no cause (a loss that diverged still is)
    unrelated = case.first.phase in ("input", "parameters") and not confidence
    if update is not None and update.ratio >= LARGE_UPDATE and not unrelated:
        evidence.append(_update(update))
        confidence = (
            min(0.95, confidence + 0.1) if confidence else (0.5 if update.ratio >= 0.1 else 0.35)
        )
    if not evidence:
        return None
    return Hit(confidence, [*evidence, _rate(case, told=jump is not None)], fix=_fix(case))


def _loss_rise(case: Case, evidence: list[str]) -> float:
    """0.85 when the loss diverged before or with the gradients, 0.5 when it climbed back
    from its best; a rise of fewer than MIN_RISE_STEPS steps is not counted (a loss that
    jumps for the last two or three steps is the failure arriving, whatever its cause)."""
    t, failing = case.trends, case.first.step
    onset = case.diverged_since
    if onset is not None:
        evidence.append(
            f"the loss diverged from step {onset}: from its best {num(t.loss_min)} "
            f"(step {t.loss_min_step}) up to {num(t.loss_last)}, before or with the gradients"
        )
        return 0.85
    best = case.climbed_since
    if best is not None:
        evidence.append(
            f"the loss climbed from its best {num(t.loss_min)} (step {best}) back "
            f"up to {num(t.loss_last)} over the {failing - best} steps before the failure"
        )
        return 0.5
    return 0.0


def _update(update: UpdateRatio) -> str:
    last = f"step {update.step}, the last update before the failure,"
    if not math.isfinite(update.ratio):
        return f"{last} left the weights non-finite ({update.largest_param} among them)"
    moved = _share(update.ratio)
    return (
        f"{last} moved the weights by {moved} {'of ' if '%' in moved else ''}their norm "
        f"({update.largest_param}: {_share(update.largest)}); about 0.1% is typical"
    )


def _share(ratio: float) -> str:
    """A step's share of the weights' norm: `14.2%`; `1.47e+10x` once it is huge."""
    return f"{ratio:.1%}" if ratio < 10 else f"{ratio:.3g}x"


def _recent_jump(case: Case) -> LrJump | None:
    jump = case.facts.lr_jump
    if jump is None or jump.factor < JUMP or jump.step > case.first.step:
        return None
    return jump if case.first.step - jump.step <= RECENT else None


def _scheduler(case: Case) -> str:
    name = case.facts.scheduler
    return f"the scheduler ({name})" if name else "the scheduler"


def _rate(case: Case, told: bool) -> str:
    """The optimizer and the rate in effect at the failing step, with where it came from
    when a scheduler had moved it from the rate the run started with (unless `told`)."""
    f = case.facts
    if f.lr is None:
        return f"the optimizer is {f.optimizer}"
    moved = f.lr_start is not None and abs(f.lr - f.lr_start) > 1e-9 * f.lr_start
    if not moved or f.lr_start is None:
        return f"the optimizer is {f.optimizer} (lr={f.lr:g})"
    at = f"lr={f.lr:g} in effect at step {case.first.step}"
    if told:
        return f"the optimizer is {f.optimizer}, at {at}"
    jump = f.lr_jump
    how = (
        f"; {_scheduler(case)} took it there from {f.lr_start:g}, jumping {jump.factor:.3g}x "
        f"at step {jump.step}"
        if jump is not None and jump.factor >= 2
        else f"; {_scheduler(case)} moved it there from {f.lr_start:g}"
    )
    return f"the optimizer is {f.optimizer}, at {at}{how}"


def _fix(case: Case) -> str | None:
    """The fix sentence with this run's numbers: from the rate in effect to 10x lower."""
    f = case.facts
    if f.lr is None:
        return None
    step, lower = case.first.step, f.lr / 10
    jump = _recent_jump(case)
    cap = (
        f", and bound the scheduler: its {jump.factor:.3g}x jump at step {jump.step} made that rate"
        if jump is not None
        else ""
    )
    if f.lr_base is not None and f.lr_base != f.lr:  # NB: the scheduler scales what you set
        base = f.lr_base
        change = f"`lr={base:g}` -> `lr={base / 10:g}`, the rate you set and the scheduler scales"
    else:
        change = f"`lr={f.lr:g}` -> `lr={lower:g}`"
    return (
        f"Lower the learning rate 10x, from the {f.lr:g} in effect at step {step} to "
        f"{lower:g} ({change}){cap}; or warm it up over the first "
        "steps: smaller updates keep the update-to-weight ratio near 1e-3, where training "
        "converges instead of diverging."
    )


FIXES = (Fix(change=Change.SMALLER_LR),)

CAUSE = CauseUnit(INFO, rule=learning_rate_too_high, fixes=FIXES)
