"""eps-underflow: an epsilon that is 0 in the training dtype (1e-8 in float16).

In the forward, an `add`/`clamp` of a constant the dtype it was added in rounds to 0, which
still left zeros; in the optimizer, an `eps` of 0 or one the parameters' dtype cannot hold.
The what-if raises the optimizer's eps for a failure in the optimizer, and otherwise
replays with the math patch that raises every epsilon the dtype rounds to 0, or, when that
patch finds no such epsilon to raise, with the origin op guarded.
"""

from __future__ import annotations

from nandoctor.causes.case import SMALLEST, Case, op_base, rounds_to_zero
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import number_in, plural
from nandoctor.report.evidence import Producer

ID = "eps-underflow"

INFO = entry(
    ID,
    title="an epsilon that is 0 in float16",
    explanation="""
    float16's smallest positive value is 2**-24 ~ 6e-8 (a subnormal), so the `1e-8` that
    guards a denominator in float32 rounds to exactly 0 in float16, and
    `x / (norm + 1e-8)` is x/0 again. Adam's default `eps=1e-8` meets the same fate when
    the parameters and optimizer state are float16 (`model.half()`): `exp_avg_sq` also
    underflows to 0 for gradients below ~5e-3 (0.001 * g**2 < 3e-8), and the update
    divides by 0.
    """,
    fix="""
    Use an epsilon the dtype can hold (1e-5 or more for float16, e.g.
    `torch.finfo(torch.float16).eps`) and keep weights and optimizer state in float32 with
    autocast + GradScaler instead of `model.half()`: the epsilon then guards the denominator
    instead of vanishing.
    """,
    before="""
    model = Net().cuda().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8 is 0 in float16
    y = x / (x.norm(dim=-1, keepdim=True) + 1e-8)
    """,
    after="""
    model = Net().cuda()  # float32 weights and Adam state; autocast runs the math in float16
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    y = x / (x.norm(dim=-1, keepdim=True) + 1e-5)
    """,
)


def eps_underflow(case: Case) -> Hit | None:
    """An epsilon that rounds to 0 in the dtype it was added in, seen as a plain-number
    argument of an op that made the origin's inputs; or an optimizer eps the parameters'
    dtype cannot hold. The mechanism itself, so it outranks the log or division it broke."""
    if case.first.phase == "optimizer":
        return _optimizer_eps(case)
    if case.zeros_in_inputs == 0:
        return None
    for p in case.evidence.producers:
        if op_base(p.op) not in GUARDS:
            continue
        dtype = _dtype_added_in(case, p)
        tiny = [s for s in p.scalars if rounds_to_zero(number_in(s), dtype)]
        if tiny:
            zeros = plural(_zeros_guarded(case, p), "exact zero")
            sentence = (
                f"{p.op} at {p.source} added {tiny[0].split('=')[-1]}, which is 0 in {dtype} "
                f"(smallest value ~{SMALLEST[str(dtype)]:.2g}), so {case.first.op} still met "
                f"{zeros}"
            )
            # NB: the catalog's fix speaks of model.half() and Adam too; this run's epsilon
            # is the one at that line (an autocast run holds float32 weights already)
            fix = (
                f"Use an epsilon {dtype} can hold at {p.source}: {tiny[0].split('=')[-1]} is 0 "
                "there; use 1e-5 or more for float16, or compute that sum in float32: the "
                "epsilon then guards the denominator instead of vanishing."
            )
            return Hit(0.95, [sentence], fix=fix)
    return None


GUARDS = frozenset({"add", "clamp", "clamp_min", "maximum", "clip"})  # ops an epsilon rides


def _zeros_guarded(case: Case, p: Producer) -> int:
    """The zeros of the input the epsilon was meant to guard (the denominator its add
    made), not the numerator's too: `x / (norm + 1e-8)` met 92 zeros, not 3036."""
    fed = case.input(p.feeds) if p.depth == 1 else case.divisor
    return fed.zeros if fed is not None and fed.zeros else case.zeros_in_inputs


def _dtype_added_in(case: Case, p: Producer) -> str | None:
    """The dtype the producer computed in: that of the origin's input it made (depth 1),
    or of the origin's inputs that held the zeros (deeper), else the origin's own."""
    if p.depth == 1 and (fed := case.input(p.feeds)) is not None:
        return fed.dtype
    zeroed = [i.dtype for i in case.evidence.inputs if i.zeros]
    return zeroed[0] if zeroed else case.first.dtype


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
    if rounds_to_zero(eps, dtype):
        return Hit(0.95, [f"the optimizer's eps={eps:g} is 0 in the {dtype} parameters' dtype"])
    return None


FIXES = (
    Fix(change=Change.OPTIMIZER_EPS, phases=frozenset({"optimizer"})),
    Fix(patch=True),
    GUARD_ORIGIN,
)

CAUSE = CauseUnit(INFO, rule=eps_underflow, fixes=FIXES)
