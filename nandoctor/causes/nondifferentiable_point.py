"""nondifferentiable-point: a backward at a point where the derivative is infinite (sqrt or a
norm at 0, acos at 1), though the forward value there is finite.

The what-if guards the forward op whose backward failed, at its line: its input kept off
the singular point (sqrt's clamped to the smallest normal number, acos's inside (-1, 1)),
so that the backward never multiplies an infinite derivative by 0.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Hit, entry
from nandoctor.causes.words import STEEP_AT_A_POINT, plural, where

ID = "nondifferentiable-point"

INFO = entry(
    ID,
    title="a backward at a point of infinite derivative",
    explanation="""
    d sqrt(x)/dx = 1/(2 sqrt(x)) is inf at x = 0, and the chain rule multiplies it by the 0
    gradient of the squares inside: inf * 0 = NaN. So `torch.sqrt(((a - b) ** 2).sum(-1))`
    has a fine forward value (0) and NaN gradients for identical points. acos and asin have
    infinite derivatives at +-1, pow(x, p) with p < 1 at 0, and `torch.xlogy(x, y)`, whose
    forward is 0 where x is 0, has x / y for its derivative in y: 0/0 where both are 0.
    `torch.linalg.vector_norm` defines a zero gradient at 0 and is safe.
    """,
    fix="""
    Keep the argument off the singular point (`torch.sqrt(x + 1e-6)`,
    `torch.acos(c.clamp(-1 + 1e-6, 1 - 1e-6))`, `torch.xlogy(x, y.clamp_min(1e-6))`) or use
    `torch.linalg.vector_norm`: the backward then never multiplies an infinite derivative
    by 0.
    """,
    before="""
    dist = torch.sqrt(((a - b) ** 2).sum(-1))
    angle = torch.acos(F.cosine_similarity(u, v))
    """,
    after="""
    dist = torch.linalg.vector_norm(a - b, dim=-1)  # gradient 0 at 0, not NaN
    angle = torch.acos(F.cosine_similarity(u, v).clamp(-1 + 1e-6, 1 - 1e-6))
    """,
)


def nondifferentiable_point(case: Case) -> Hit | None:
    if case.first.phase != "backward" or case.backward_of not in STEEP_AT_A_POINT:
        return None
    zeros = case.zeros_in_inputs
    recompute = case.evidence.recompute
    if recompute is not None and recompute.finite:
        # NB: finite in float32 on the same inputs: an overflow, as GELU's pow(x, 3) in
        # float16 makes (an infinite derivative is infinite in every dtype), whatever
        # stray exact zero its inputs hold (one in 16384 of a diverged GPT-2's gradient)
        return None
    if zeros == 0 and recompute is None:
        # NB: no singular point met (the backward's zeros: 2 sqrt(0), 1 - x^2 at acos's ±1)
        return None
    detail = f" (its backward met {plural(zeros, 'exact zero')})" if zeros else ""
    singular = (
        "its derivative in y, x / y, is 0/0 where both inputs are 0"
        if case.backward_of == "xlogy"
        else "its derivative is infinite where the forward input is 0 (or at ±1 for acos/asin)"
    )
    sentence = (
        f"the backward of {case.evidence.backward_of}{where(case)} made "
        f"{case.first.value}{detail}: {singular}, though the forward value is finite"
    )
    return Hit(0.9, [sentence])


CAUSE = CauseUnit(INFO, rule=nondifferentiable_point, fixes=(GUARD_ORIGIN,))
