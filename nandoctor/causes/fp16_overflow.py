"""fp16-overflow: a finite computation exceeded float16's range (65504).

The evidence is the float32 recomputation of the op (finite, beyond 65504), inputs or
modules already near the limit. The what-if replays the run in bfloat16.
"""

from __future__ import annotations

from nandoctor.causes.case import FLOAT16_MAX, Case, op_base
from nandoctor.causes.unit import CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import OVERFLOWED, num, where

ID = "fp16-overflow"
EXP_FLOAT16 = 11.09  # ln(65504): exp overflows float16 above it

INFO = entry(
    ID,
    title="a finite value exceeded float16's range (65504)",
    explanation="""
    float16 has 5 exponent bits: its largest finite value is 65504, and anything larger
    becomes inf, which the next op turns into NaN (inf - inf, 0 * inf). Values that are
    harmless in float32 overflow there: attention logits of 12 fed to exp (e^12 ~ 163000),
    a sum of 4096 activations of 20, the square of 300. bfloat16 spends the same 16 bits
    differently: float32's 8 exponent bits, so its range reaches ~3.4e38, paid for with
    precision: 8 significand bits (2-3 decimal digits) against float16's 11.
    """,
    fix="""
    Train in bfloat16 (`torch.autocast(device, dtype=torch.bfloat16)`, no GradScaler
    needed): its 8 exponent bits reach ~3.4e38 instead of 65504. Where float16 must stay,
    keep the overflowing op in float32 and scale values down before it.
    """,
    before="""
    scaler = torch.cuda.amp.GradScaler()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    """,
    after="""
    with torch.autocast("cuda", dtype=torch.bfloat16):  # range ~3.4e38, no loss scaling
        loss = model(x, y)
    loss.backward()
    """,
)


def fp16_overflow(case: Case) -> Hit | None:
    """The failing op's own overflow first; else one upstream that healed into it."""
    return _overflow_here(case) or _overflow_upstream(case)


def _overflow_here(case: Case) -> Hit | None:
    if case.first.dtype != "float16" or case.first.value not in OVERFLOWED:
        return None
    recompute = case.evidence.recompute
    near = [m for m in case.evidence.modules if (m.activation_absmax or 0) >= 0.5 * FLOAT16_MAX]
    evidence = []
    if recompute is not None and recompute.finite and (recompute.absmax or 0) > FLOAT16_MAX:
        evidence.append(
            f"{case.first.op}{where(case)} gives |x| up to {num(recompute.absmax)} in float32, "
            "beyond float16's 65504: it overflowed"
        )
    biggest = max((i.absmax for i in case.evidence.inputs), default=0.0)
    if biggest >= 0.25 * FLOAT16_MAX:
        evidence.append(
            f"its inputs already reached |x| = {num(biggest)} ({biggest / FLOAT16_MAX:.0%} "
            "of float16's range)"
        )
    evidence += [
        f"module {m.module or '(root)'} ({m.type}) reached |x| = {num(m.activation_absmax)}"
        for m in near[:2]
    ]
    if not evidence:
        return None
    confidence = 0.9 if len(evidence) > 1 or evidence[0].startswith(case.first.op or "-") else 0.6
    confidence -= 0.15 if case.first.phase == "backward" else 0.0
    since = case.diverged_since
    since = since if since is not None else case.climbed_since
    if since is not None:  # NB: the overflow is where a divergence met 65504, not its cause
        evidence.append(
            f"but the loss had been climbing since step {since}: float16's range is where "
            "the divergence showed, and bfloat16 would only let it run on"
        )
        confidence -= 0.35
    made_by = _exponential(case)
    if made_by is None:
        return Hit(confidence, evidence)
    op, source = made_by
    at = f" at {source}" if source else ""
    evidence.append(f"the value overflowing is an exponential's: {op}{at}")
    return Hit(confidence, evidence, fix=f"{BOUND_THE_EXPONENT.format(at=at)} {INFO.fix}")


# NB: an exponential of an argument nothing bounds (a learned temperature, the log-variance
# of inputs never normalised) passes any range: bfloat16 keeps the run finite on values it
# cannot train with (a CLIP temperature of 1.6e6: its loss 7500x chance), so the bound
# comes first, and bfloat16 for values meant to be that large
BOUND_THE_EXPONENT = (
    "An exponential made it{at}: normalise in log space (`torch.softmax`, `torch.logsumexp` "
    "subtract the maximum first), and bound an exponent nothing bounds "
    "(`logit_scale.clamp(max=math.log(100))` for a learned temperature, "
    "`logvar.clamp(max=20)` for a log-variance): an exponential of an unbounded argument "
    "outgrows every range, bfloat16's too."
)


def _exponential(case: Case) -> tuple[str, str | None] | None:
    """(op, source) of the exponential that made the overflowing value: the failing op
    itself, fed an exponent past float16's (~11.1), or what made its largest input."""
    x = case.input("self")
    if op_base(case.first.op or "") == "exp" and x is not None and x.max > EXP_FLOAT16:
        return case.first.op or "exp", case.first.source
    biggest = max(case.evidence.inputs, key=lambda i: i.absmax, default=None)
    if biggest is None or biggest.absmax < 0.25 * FLOAT16_MAX:
        return None
    for p in case.producers(1):
        if p.feeds == biggest.name and op_base(p.op) == "exp":
            return p.op, p.source
    return None


EXPONENTIALS = frozenset({"exp", "exp2", "expm1", "pow", "cosh", "sinh"})


def _overflow_upstream(case: Case) -> Hit | None:
    """An exponential that overflowed float16 earlier in the failing step, its inf
    healed on the way (`e / e.sum()` with an inf in the sum is 0): the zero the failing
    log or division met may be that overflow's. A hypothesis for the replay to test (its
    fix, bfloat16, is replayed), not a certainty: the value healed."""
    if case.facts.dtype != "float16":
        return None
    for t in case.transients:
        if t.step == case.first.step and t.value == "inf" and op_base(t.op) in EXPONENTIALS:
            at = f" at {t.source}" if t.source else ""
            sentence = (
                f"{t.op}{at} overflowed float16 to inf earlier in step {t.step} ({t.phase}); "
                "the inf healed on the way (x / inf is 0), into the values that failed"
            )
            return Hit(0.6, [sentence])
    return None


FIXES = (Fix(change=Change.BFLOAT16),)

CAUSE = CauseUnit(INFO, rule=fp16_overflow, fixes=FIXES)
