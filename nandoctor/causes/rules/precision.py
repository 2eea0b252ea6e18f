"""Causes of the number format: a value beyond float16's range, an epsilon it rounds
to 0, an infinity put in on purpose that came out as NaN."""

from __future__ import annotations

from nandoctor.causes.case import FLOAT16_MAX, FLOAT16_ROUNDS_TO_ZERO, Case, op_base
from nandoctor.causes.rules.registry import SOFTMAXES, Hit, num, number_in, rule, where


@rule("fp16-overflow")
def fp16_overflow(case: Case) -> Hit | None:
    if case.first.dtype != "float16" or case.first.value not in ("inf", "-inf", "mixed"):
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
    return Hit(confidence - (0.15 if case.first.phase == "backward" else 0.0), evidence)


@rule("eps-underflow")
def eps_underflow(case: Case) -> Hit | None:
    if case.first.phase == "optimizer":
        return _optimizer_eps(case)
    if case.first.dtype != "float16" or case.zeros_in_inputs == 0:
        return None
    for p in case.evidence.producers:
        tiny = [s for s in p.scalars if 0 < abs(number_in(s)) < FLOAT16_ROUNDS_TO_ZERO]
        if tiny and op_base(p.op) in ("add", "clamp", "clamp_min", "maximum"):
            return Hit(
                0.9,
                [
                    (
                        f"{p.op} at {p.source} added {tiny[0].split('=')[-1]}, which is 0 in "
                        f"float16 (smallest value ~6e-8), so {case.first.op} still met "
                        f"{case.zeros_in_inputs} exact zero(s)"
                    )
                ],
            )
    return None


def _optimizer_eps(case: Case) -> Hit | None:
    eps, dtype = case.facts.eps, case.facts.param_dtype
    if eps is None or case.op not in ("div", "addcdiv", "sqrt", "add"):
        return None
    if eps == 0:
        return Hit(
            0.9,
            [
                (
                    f"the optimizer {case.facts.optimizer} runs with eps=0: a parameter whose "
                    f"gradient is exactly 0 gets 0/0 = NaN in {case.first.op}"
                )
            ],
        )
    if dtype == "float16" and eps < FLOAT16_ROUNDS_TO_ZERO:
        return Hit(0.9, [f"the optimizer's eps={eps:g} is 0 in the float16 parameters' dtype"])
    return None


@rule("fully-masked-softmax")
def fully_masked_softmax(case: Case) -> Hit | None:
    if case.op not in SOFTMAXES | {"sub", "exp"} or not case.created_nan:
        return None
    masked = sum(i.neginf for i in case.evidence.inputs)
    if masked == 0:
        return None
    confidence = 0.92 if case.op in SOFTMAXES else 0.7
    sentence = (
        f"{case.first.op}{where(case)} received {masked} -inf value(s) and made "
        f"{case.first.count_nonfinite} NaN: a row that is entirely -inf gives "
        "exp(-inf)/sum = 0/0"
    )
    return Hit(confidence, [sentence])
