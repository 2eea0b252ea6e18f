"""division-by-zero: 0/0 or x/0 in the forward or the loss, a denominator holding exact zeros.

The what-if guards that division at that line: its denominator moved away from 0 (|d| at
least the dtype's eps), the way `clamp_min` or `F.normalize` would bound it.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Hit, entry
from nandoctor.causes.words import plural, where

ID = "division-by-zero"

INFO = entry(
    ID,
    title="0/0 or x/0 in user math",
    explanation="""
    `x / x.sum()` or `x / x.norm()` is inf (x/0) or NaN (0/0) as soon as the denominator is
    exactly 0: an all-zero row, an empty mask, a batch in which every label is ignored. The
    backward is worse than the forward: d(a/b)/db = -a/b**2 overflows float16 already for
    b = 1e-3 and a = 0.1 (1e5 > 65504).
    """,
    fix="""
    Bound the denominator with an epsilon the dtype can hold or a clamp
    (`mask.sum().clamp_min(1)`, `x.norm(dim=-1, keepdim=True).clamp_min(1e-6)`, or
    `F.normalize(x, dim=-1)`): a bounded denominator bounds both the value and its gradient.
    """,
    before="""
    loss = (per_token * mask).sum() / mask.sum()
    unit = x / x.norm(dim=-1, keepdim=True)
    """,
    after="""
    loss = (per_token * mask).sum() / mask.sum().clamp_min(1)
    unit = F.normalize(x, dim=-1)  # divides by max(norm, 1e-12)
    """,
)


def division_by_zero(case: Case) -> Hit | None:
    denominator = case.divisor
    if case.op != "div" or case.first.phase not in ("forward", "loss") or denominator is None:
        return None
    if denominator.zeros == 0:
        return None
    made = case.producers(1, feeds="other")
    source = f", made by {made[0].op}" if made else ""
    kind = "0/0 = NaN" if case.first.value == "nan" else "x/0 = inf"
    sentence = (
        f"{case.first.op}{where(case)} divided by {plural(denominator.zeros, 'exact zero')} in "
        f"its denominator{source}: {kind}"
    )
    return Hit(0.85, [sentence])


CAUSE = CauseUnit(INFO, rule=division_by_zero, fixes=(GUARD_ORIGIN,))
