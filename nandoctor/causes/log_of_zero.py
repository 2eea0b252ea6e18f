"""log-of-zero: a log, reciprocal or rsqrt that met an exact zero no softmax produced.

The zero comes from the user's math (a ReLU, a mask, padding), and which of the stable
rewrites fits is the user's call; the what-if guards the op at that line (its input
clamped to the dtype's smallest normal number, a reciprocal's moved away from 0) to show
whether that zero is the whole story.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Hit, entry
from nandoctor.causes.words import LOGS, PROBABILITIES, plural, where

ID = "log-of-zero"

INFO = entry(
    ID,
    title="log, reciprocal or division meeting an exact zero",
    explanation="""
    log(0) is -inf and 1/0 is inf in every dtype, and the backward of log(x) is 1/x, so even
    a loss that stays finite can send an inf gradient. The zeros come from ReLU outputs,
    empty masks, padding, and `1 - sigmoid(z)`: the sigmoid rounds to exactly 1 once z
    passes ~8.3 in float16 (~6.2 in bfloat16, ~16.6 even in float32). An epsilon helps only
    if the dtype can hold it: `1e-8` is exactly 0 in float16.
    """,
    fix="""
    Stay in log space with the fused op (`F.binary_cross_entropy_with_logits`,
    `F.logsigmoid`, `torch.log1p`) or clamp the argument with
    `clamp_min(torch.finfo(x.dtype).tiny)`: the log then stays finite and its gradient
    bounded (not `torch.xlogy(x, y)` where y needs a gradient: in y it is x / y, 0/0 at 0).
    """,
    before="""
    p = torch.sigmoid(z)
    loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    """,
    after="""
    loss = F.binary_cross_entropy_with_logits(z, y)
    """,
)


def log_of_zero(case: Case) -> Hit | None:
    if case.op not in LOGS | {"reciprocal", "rsqrt"} or case.zeros_in_inputs == 0:
        return None
    if case.made_by(PROBABILITIES) is not None or case.first.phase == "backward":
        return None
    made = case.producers(1)
    origin = f" (made by {made[0].op})" if made else ""
    sentence = (
        f"{case.first.op}{where(case)} met {plural(case.zeros_in_inputs, 'exact zero')}{origin}: "
        f"the result is {case.first.value}"
    )
    return Hit(0.85, [sentence], fix=_NOT_A_LOG.get(case.op))


# NB: a reciprocal or rsqrt of 0 is no log: the catalog's log-space advice does not apply
_NOT_A_LOG = {
    # an RMSNorm's rsqrt(mean(x^2) + eps): what it scales is ~0 too, so any floor works
    "rsqrt": (
        "Keep the argument off 0: add an epsilon the dtype holds (`torch.rsqrt(v + eps)` "
        "with eps at least `torch.finfo(v.dtype).tiny`; 1e-12 is 0 in float16) or clamp it "
        "with `clamp_min(torch.finfo(v.dtype).tiny)`: the result then stays finite."
    ),
    # a weight 1 / sigma**2, a mean over a count: 1 / tiny (~1e38 in float32) is finite
    # and swamps the loss it multiplies, so the floor must be on the quantity's own scale
    "reciprocal": (
        "Keep the divisor off 0 at a floor on its own scale, the smallest value it "
        "meaningfully takes: `1 / sigma.clamp_min(1e-3)` for a noise level, "
        "`1 / n.clamp_min(1)` for a count; not the dtype's `tiny`, whose reciprocal (~1e38 "
        "in float32) is finite but swamps whatever it multiplies."
    ),
}


CAUSE = CauseUnit(INFO, rule=log_of_zero, fixes=(GUARD_ORIGIN,))
