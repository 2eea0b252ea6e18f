"""float32-overflow: a finite computation exceeded float32's range (~3.4e38), which
bfloat16 shares.

float16's overflow has its own id and its own fix (bfloat16); past float32's range no
dtype switch helps, so this cause is about the formula. The rule wants an exponential
that made the inf itself (its inputs all finite) from an argument beyond its limit
(ln(3.4e38) ~ 88.7 for exp): exp without subtracting the max first. Any other op that
overflows float32 (a product, a sum) only says that its inputs had grown huge: the
training-dynamics causes name that growth from the telemetry (on the exploding-gradients
and learning-rate-too-high examples a product overflows), so it is not claimed here,
unless nothing could have grown: at the run's first step, inputs already past 1e30 (a
VAE's exp(logvar) of pixels never normalised: 3e36 in the backward of step 0) are the
formula's or the data's.

The what-if guards the origin op, which only helps an exp of a learnable scale (one value,
CLIP's `logit_scale.exp()`): capped at ln(100), as CLIP's training caps it. For any other
exponent the fix rewrites the formula, which nandoctor cannot do for the user, and the
report says so (float32 changes nothing for an op that overflowed float32).
"""

from __future__ import annotations

import math

from nandoctor.causes.case import Case
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Hit, entry
from nandoctor.causes.words import OVERFLOWED, num, where

ID = "float32-overflow"

FLOAT32_MAX = 3.4028234663852886e38
WIDE = frozenset({"float32", "bfloat16"})  # the dtypes whose range this is
# the exponentials, each with the largest argument whose result float32 holds
EXP_LIMITS = {
    "exp": math.log(FLOAT32_MAX),  # ~88.72
    "expm1": math.log(FLOAT32_MAX),
    "exp2": math.log2(FLOAT32_MAX),  # ~128
    "cosh": math.log(2 * FLOAT32_MAX),  # ~89.4
    "sinh": math.log(2 * FLOAT32_MAX),
}

INFO = entry(
    ID,
    title="a finite value exceeded float32's range (~3.4e38)",
    explanation="""
    float32 and bfloat16 share 8 exponent bits: their largest finite value is ~3.4e38,
    and anything larger becomes inf, which the next op turns into NaN (inf / inf,
    inf - inf). Normal training never comes near it; what does is an exponential of
    a large argument: exp overflows for arguments above ~88.7, so a softmax written
    by hand as `exp(x) / exp(x).sum()` overflows on logits of 89, a log-variance of 100
    in `exp(logvar)` is inf, and so is a learned temperature `logit_scale.exp()` that
    grew past 88.7. Other ops (a product, a sum) reach it only when their inputs have
    grown huge already: then the growth, not the op, is the cause.
    """,
    fix="""
    Exponentiate in log space: `torch.softmax`, `torch.log_softmax` and `torch.logsumexp`
    subtract the maximum before exp; `F.softplus(x)` replaces `log(1 + exp(x))`. Where a
    large exponent is meant, bound it: `torch.exp(logvar.clamp(max=20))`,
    `logit_scale.clamp(max=math.log(100))`. If the values grew over the run, lower the
    learning rate or clip the gradients (see learning-rate-too-high).
    """,
    before="""
    e = torch.exp(logits)
    probs = e / e.sum(dim=-1, keepdim=True)
    """,
    after="""
    probs = torch.softmax(logits, dim=-1)  # subtracts the max first: never overflows
    """,
)


def float32_overflow(case: Case) -> Hit | None:
    if case.first.value not in OVERFLOWED:
        return None
    if case.first.dtype not in WIDE and not _past_float32_too(case):
        return None
    return _exponential(case) or _huge_at_once(case)


def _huge_at_once(case: Case) -> Hit | None:
    """Inputs one product away from float32's range at the run's first step."""
    if case.first.step != case.facts.start_step:
        return None
    biggest = max((i.absmax for i in case.evidence.inputs), default=0.0)
    if biggest < HUGE or any(i.nonfinite for i in case.evidence.inputs):
        return None
    sentence = (
        f"{case.first.op}{where(case)} received values up to {num(biggest)} at the run's "
        "first step: nothing had time to grow, so the formula or the data made them, and "
        "past float32's ~3.4e38 (bfloat16's range too) no dtype holds them"
    )
    return Hit(0.6, [sentence])


HUGE = 1e30  # finite values this large are a product away from float32's range


def _exponential(case: Case) -> Hit | None:
    limit = EXP_LIMITS.get(case.op)
    x = case.input("self")
    if limit is None or x is None or any(i.nonfinite for i in case.evidence.inputs):
        return None  # NB: an inf that came in was made upstream, by whatever made it
    largest = x.absmax if case.op in ("cosh", "sinh") else x.max
    if largest <= limit:
        return None
    return Hit(
        0.85,
        [
            f"{case.first.op}{where(case)} received arguments up to {num(largest)}: "
            f"{case.op} overflows float32 (and bfloat16) above {limit:.1f}"
        ],
    )


def _past_float32_too(case: Case) -> bool:
    """A float16 exponential that is inf in float32 too (under the CPU's own autocast
    lists exp stays in float16): past float32's limit every dtype overflows, and
    fp16-overflow, which wants the op finite in float32, does not claim it."""
    recompute = case.evidence.recompute
    return case.first.dtype == "float16" and recompute is not None and not recompute.finite


CAUSE = CauseUnit(INFO, rule=float32_overflow, fixes=(GUARD_ORIGIN,))
