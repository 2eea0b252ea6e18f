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
    if case.op in NLL and case.first.phase in ("forward", "loss"):
        return _nothing_to_average(case)
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


NLL = frozenset({"nll_loss_forward", "nll_loss2d_forward"})  # cross_entropy's reduction


def _nothing_to_average(case: Case) -> Hit | None:
    """A mean cross-entropy over a batch in which every target is `ignore_index` (an MLM
    batch with no masked token, an SFT batch of prompts only): a sum over no label divided
    by a count of 0, NaN. The op reads as `nll_loss_forward`, no `div` anywhere."""
    target, scalars = case.input("target"), dict(_pairs(case.evidence.scalars))
    ignored = scalars.get("ignore_index")
    if target is None or ignored is None or scalars.get("reduction") != "1":
        return None
    if case.first.value != "nan" or not (target.min == target.max == float(ignored)):
        return None
    sentence = (
        f"{case.first.op}{where(case)} averaged over no label: all "
        f"{plural(target.numel, 'target')} are ignore_index ({ignored}), and a mean over none "
        "is 0/0 = NaN; skip such batches, or divide the summed loss by max(count, 1)"
    )
    return Hit(0.9, [sentence])


def _pairs(scalars: list[str]) -> list[tuple[str, str]]:
    """The evidence's `name=value` scalars, as (name, value)."""
    return [(name, value) for name, eq, value in (s.partition("=") for s in scalars) if eq]


CAUSE = CauseUnit(INFO, rule=division_by_zero, fixes=(GUARD_ORIGIN,))
