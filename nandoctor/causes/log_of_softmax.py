"""log-of-softmax: a log taken of a softmax probability that underflowed to exactly 0.

The rule wants a log that met exact zeros made by a softmax or sigmoid, or the backward
of such a log (its -inf thrown away in the forward, its gradient's 0/0 kept); the what-if replays
the run with `log(softmax(x))` rewritten to `log_softmax(x)` by the math patch, or, where
there is no such pair to rewrite (`log(sigmoid(x))`), with the log at that line guarded.
"""

from __future__ import annotations

from nandoctor.causes.case import Case, op_base
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Fix, Hit, entry
from nandoctor.causes.words import LOGS, PROBABILITIES, plural
from nandoctor.report.evidence import Producer

ID = "log-of-softmax"

INFO = entry(
    ID,
    title="log of a softmax that underflowed to 0",
    explanation="""
    A softmax probability rounds to exactly 0 once its logit trails the largest one by more
    than ~17.3 in float16 (exp(-18) ~ 1.5e-8 is below the smallest float16 value, 6e-8) or
    ~104 in float32. log(0) is -inf; times a zero target it is NaN, and the backward of log
    divides by that 0. `log_softmax` computes `x - logsumexp(x)` directly, so it never forms
    the 0: a logit 1000 below the top just gives a log-probability of -1000. A sigmoid's
    probability underflows the same way: to exactly 0 below z ~ -17.3 in float16 (~ -88.7
    in bfloat16 and float32).
    """,
    fix="""
    Use `F.cross_entropy(logits, target)`, or `F.log_softmax(logits, dim=-1)` where you need
    the log-probabilities (of a sigmoid: `F.binary_cross_entropy_with_logits`,
    `F.logsigmoid`): they never take the log of a probability that underflowed to 0.
    """,
    before="""
    probs = torch.softmax(logits, dim=-1)
    loss = -(target * torch.log(probs)).sum(-1).mean()
    """,
    after="""
    loss = F.cross_entropy(logits, target)  # class indices or probabilities
    # or, when you need the log-probabilities themselves:
    log_probs = F.log_softmax(logits, dim=-1)
    loss = -(target * log_probs).sum(-1).mean()
    """,
)


def log_of_softmax(case: Case) -> Hit | None:
    if case.op in LOGS:
        return _hit(case, case.made_by(PROBABILITIES), case.zeros_in_inputs, case.first.op)
    if case.first.phase == "backward" and case.backward_of in LOGS:
        # NB: log(0)'s -inf discarded in the forward (a gather of the target's column, a
        # zero weight in nll_loss); the backward of log divides by the same 0: 0/0 = NaN
        producer = case.made_by(PROBABILITIES, feeds="other")
        zeros = case.divisor.zeros if case.divisor is not None else 0
        hit = _hit(case, producer, zeros, f"the backward of {case.evidence.backward_of}")
        if hit is not None:
            hit.evidence.append("log's gradient is 1/x: at x = 0 it is 0/0 = NaN, or inf")
        return hit
    return None


def _hit(case: Case, producer: Producer | None, zeros: int, what: str | None) -> Hit | None:
    if producer is None or zeros == 0:
        return None
    at = f" at {producer.source}" if producer.source else ""
    evidence = [f"{what} received {plural(zeros, 'exact zero')} produced by {producer.op}{at}"]
    if case.first.dtype == "float16":
        evidence.append("in float16 a probability below ~6e-8 rounds to exactly 0; log(0) = -inf")
    fix = _FIXES[op_base(producer.op)]
    if producer.module and not case.first.module:  # NB: probabilities out of the model
        fix += _PROBABILITIES_ONLY
    return Hit(0.93, evidence, fix=fix)


# NB: the model made the probabilities (attention weights a loss term reads): no logits
_PROBABILITIES_ONLY = (
    " Holding only the probabilities the model returns (attention weights), take their "
    "log safely: `p.clamp_min(torch.finfo(p.dtype).tiny).log()` (for p * log(p), its "
    "gradient stays finite at p = 0, where `torch.xlogy(p, p)`'s is NaN)."
)
# NB: this run's fix names the probability that underflowed (the catalog's names both)
_FIXES = {
    "softmax": (
        "Use `F.cross_entropy(logits, target)`, or `F.log_softmax(logits, dim=-1)` where you "
        "need the log-probabilities: they never take the log of a probability that "
        "underflowed to 0."
    ),
    "sigmoid": (
        "Use `F.binary_cross_entropy_with_logits(z, target)`, or `F.logsigmoid(z)` (and "
        "`F.logsigmoid(-z)` for log(1 - sigmoid(z))) where you need the log-probabilities: "
        "they never take the log of a probability that underflowed to 0."
    ),
}


FIXES = (Fix(patch=True), GUARD_ORIGIN)

CAUSE = CauseUnit(INFO, rule=log_of_softmax, fixes=FIXES)
