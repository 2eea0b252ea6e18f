"""invalid-domain: log or sqrt of a negative number, acos or asin beyond [-1, 1], log1p below -1.

The rule wants the op to have made the NaN itself (no NaN among its inputs) from an input
outside its domain. The what-if guards the op at that line: its input clamped into the
domain (to the smallest normal number for log and sqrt, inside (-1, 1) for acos/asin).
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Hit, entry
from nandoctor.causes.words import LOGS, ROOTS, num, plural, where

ID = "invalid-domain"

INFO = entry(
    ID,
    title="log or sqrt of a negative number, acos outside [-1, 1]",
    explanation="""
    log and sqrt of a negative number and acos or asin of a value outside [-1, 1] are NaN in
    every dtype. The argument is meant to be in range and misses by a rounding error: a
    variance computed as `E[x**2] - E[x]**2` comes out as -1e-7, a cosine computed as the
    dot product of normalised vectors as 1.0000001.
    """,
    fix="""
    Clamp into the domain before the op (`torch.sqrt(var.clamp_min(0))`,
    `torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6))`) or use the stable formula (`torch.var`,
    `F.cosine_similarity`): rounding can then no longer push the argument out of range.
    """,
    before="""
    var = (x**2).mean(-1) - x.mean(-1) ** 2
    std = torch.sqrt(var)
    """,
    after="""
    var = x.var(-1, unbiased=False)  # never negative
    std = torch.sqrt(var + 1e-5)
    """,
)


def invalid_domain(case: Case) -> Hit | None:
    if not case.created_nan:
        return None
    x = case.input("self")
    if x is None:
        return None
    if case.op in LOGS | ROOTS and x.negatives > 0 and x.min < 0:
        negatives = plural(x.negatives, "negative value")
        return Hit(
            0.92, [f"{case.first.op}{where(case)} received {negatives} (min {num(x.min)}): NaN"]
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


CAUSE = CauseUnit(INFO, rule=invalid_domain, fixes=(GUARD_ORIGIN,))
