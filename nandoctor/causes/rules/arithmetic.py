"""Causes in the math itself: a log, a division, a root or its derivative met a value
outside its domain."""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.rules.registry import (
    LOGS,
    PROBABILITIES,
    ROOTS,
    STEEP_AT_A_POINT,
    Hit,
    num,
    rule,
    where,
)


@rule("log-of-softmax")
def log_of_softmax(case: Case) -> Hit | None:
    if case.op not in LOGS or case.zeros_in_inputs == 0:
        return None
    producer = case.made_by(PROBABILITIES)
    if producer is None:
        return None
    zeros = case.zeros_in_inputs
    at = f" at {producer.source}" if producer.source else ""
    evidence = [f"{case.first.op} received {zeros} exact zero(s) produced by {producer.op}{at}"]
    if case.first.dtype == "float16":
        evidence.append("in float16 a probability below ~6e-8 rounds to exactly 0; log(0) = -inf")
    return Hit(0.93, evidence)


@rule("log-of-zero")
def log_of_zero(case: Case) -> Hit | None:
    if case.op not in LOGS | {"reciprocal", "rsqrt"} or case.zeros_in_inputs == 0:
        return None
    if case.made_by(PROBABILITIES) is not None or case.first.phase == "backward":
        return None
    made = case.producers(1)
    origin = f" (made by {made[0].op})" if made else ""
    sentence = (
        f"{case.first.op}{where(case)} met {case.zeros_in_inputs} exact zero(s){origin}: "
        f"the result is {case.first.value}"
    )
    return Hit(0.85, [sentence])


@rule("division-by-zero")
def division_by_zero(case: Case) -> Hit | None:
    denominator = case.input("other")
    if case.op != "div" or case.first.phase not in ("forward", "loss") or denominator is None:
        return None
    if denominator.zeros == 0:
        return None
    made = case.producers(1, feeds="other")
    source = f", made by {made[0].op}" if made else ""
    kind = "0/0 = NaN" if case.first.value == "nan" else "x/0 = inf"
    sentence = (
        f"{case.first.op}{where(case)} divided by {denominator.zeros} exact zero(s) in its "
        f"denominator{source}: {kind}"
    )
    return Hit(0.85, [sentence])


@rule("invalid-domain")
def invalid_domain(case: Case) -> Hit | None:
    if not case.created_nan:
        return None
    x = case.input("self")
    if x is None:
        return None
    if case.op in LOGS | ROOTS and x.negatives > 0 and x.min < 0:
        return Hit(
            0.92,
            [
                (
                    f"{case.first.op}{where(case)} received {x.negatives} negative value(s) (min "
                    f"{num(x.min)}): NaN"
                )
            ],
        )
    if case.op in ("acos", "asin") and x.absmax > 1:
        return Hit(
            0.92,
            [
                (
                    f"{case.first.op}{where(case)} received values beyond [-1, 1] (|x| up to "
                    f"{x.absmax:.6g}): NaN"
                )
            ],
        )
    if case.op == "log1p" and x.min < -1:
        return Hit(
            0.92, [f"{case.first.op}{where(case)} received values below -1 (min {num(x.min)}): NaN"]
        )
    return None


def number_in(scalar: str) -> float:
    try:
        return float(scalar.split("=", 1)[-1])
    except ValueError:
        return 0.0


@rule("nondifferentiable-point")
def nondifferentiable_point(case: Case) -> Hit | None:
    if case.first.phase != "backward" or case.backward_of not in STEEP_AT_A_POINT:
        return None
    zeros = case.zeros_in_inputs
    detail = f" (its backward met {zeros} exact zero(s))" if zeros else ""
    sentence = (
        f"the backward of {case.evidence.backward_of}{where(case)} made "
        f"{case.first.value}{detail}: its derivative is infinite where the forward input "
        "is 0 (or at ±1 for acos/asin), though the forward value is finite"
    )
    return Hit(0.9, [sentence])
