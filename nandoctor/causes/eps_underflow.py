"""eps-underflow: an epsilon that is 0 in the training dtype (1e-8 in float16).

In the forward or the loss, an op that guards a value from 0 (`var + eps`, `clamp_min(eps)`,
`maximum(n, eps)`, `where(n > eps, n, eps)`) was given an epsilon that the dtype it computed
in rounds to 0: a number, a buffer or one-element tensor (a float16 model's buffer holds the
0 already), or a fill; the zeros it was to guard reached the op that failed (a denominator's,
a log's argument). In the optimizer, an `eps` of 0 or one the parameters' dtype cannot hold
(Adam's 1e-8 in a `model.half()`). The what-if raises the optimizer's eps for a failure in
the optimizer, and otherwise replays with the math patch that raises every epsilon the dtype
rounds to 0, or, when that patch finds no such epsilon to raise, with the origin op guarded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nandoctor.causes.case import ROUNDS_TO_ZERO, SMALLEST, Case, op_base, rounds_to_zero
from nandoctor.causes.unit import GUARD_ORIGIN, CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import number_in, plural

if TYPE_CHECKING:  # NB: annotations only (`lint` loads the causes for their texts)
    from nandoctor.report.evidence import Producer, TensorStats

ID = "eps-underflow"

INFO = entry(
    ID,
    title="an epsilon that is 0 in float16",
    explanation="""
    float16's smallest positive value is 2**-24 ~ 6e-8 (a subnormal), so the `1e-8` that
    guards a denominator in float32 rounds to exactly 0 in float16, and
    `x / (norm + 1e-8)` is x/0 again; so does a floor (`clamp_min(1e-8)`,
    `torch.maximum(n, eps)`), a float32 buffer added to a float16 sum, and a buffer that
    `model.half()` rounded to 0 itself. Adam's default `eps=1e-8` meets the same fate when
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
    """An epsilon that rounds to 0 in the dtype it was added in, on the way of the zeros
    that made the failure (the denominator's, not the numerator's): a plain number, a
    buffer or one-element tensor, or a fill, that an add, a clamp, a maximum or a `where`
    was given, one or two ops back; or an optimizer eps the parameters' dtype cannot hold.
    The mechanism itself, so it outranks the log or division it broke: an epsilon the
    dtype holds would have kept those zeros from the op."""
    if case.first.phase == "optimizer":
        return _optimizer_eps(case)
    for p, guarded in _guards(case):
        dtype = _dtype_added_in(case, p)
        lost = next((s for s in p.scalars if _lost(s, dtype)), None)
        if lost is not None:
            return _hit(case, p, Constant.of(lost), guarded, dtype)
    return None


GUARDS = frozenset({"add", "clamp", "clamp_min", "maximum", "fmax", "clip", "where"})
_VERB = {"add": "added", "where": "fell back to"}  # NB: the others floor the value: "floored at"
# what the denominator's zeros make an op non-finite through: the divisor, not the numerator
_DANGER = {"div": "other", "reciprocal": "self", "addcdiv": "tensor2"}
_HELD = {"float16": "1e-5", "bfloat16": "1.2e-38", "float32": "1.2e-38"}  # or more


@dataclass(frozen=True)
class Constant:
    """A number a guard op was given, as the tracer wrote it: `other=1e-08`, or, for a
    tensor, `other=1e-08 (buffer norm.eps)` (see localize/provenance.py)."""

    text: str  # "1e-08"
    value: float
    given: str | None  # "buffer norm.eps", "full_like", "a float32 tensor"; None: a number

    @classmethod
    def of(cls, scalar: str) -> Constant:
        number, _, given = scalar.split("=", 1)[-1].partition(" ")
        return cls(number, number_in(scalar), given.strip("()") or None)

    @property
    def named(self) -> bool:
        """A model's buffer or parameter named as an epsilon is (eps, epsilon, norm_eps)."""
        return self.given is not None and self.given.startswith(("buffer ", "parameter "))

    def words(self) -> str:
        """ "1e-08", "the buffer norm.eps (1e-08)", "a full_like of 1e-08"."""
        if self.given in (None, "scalar_tensor"):  # NB: torch made that one of a number
            return self.text
        if self.named or self.given.startswith("a "):
            what = self.given if self.given.startswith("a ") else f"the {self.given}"
            return f"{what} ({self.text})" if self.value else what
        return f"a {self.given} of {self.text}"


def _lost(scalar: str, dtype: str | None) -> bool:
    """The guard's number is 0 in `dtype`: one that rounds to 0 there, or a buffer named as
    an epsilon that holds 0 already (a float16 model's, which its `half()` rounded)."""
    key = scalar.split("=", 1)[0]
    if key in ("alpha", "max"):
        return False
    c = Constant.of(scalar)
    return rounds_to_zero(c.value, dtype) or (
        c.value == 0 and c.named and "eps" in (c.given or "").rsplit(".", 1)[-1].lower()
    )


def _guards(case: Case) -> Iterator[tuple[Producer, TensorStats]]:
    """The guard ops on the way of the zeros that made the failure, with the input of the
    origin op that held them: a guard that made that input (depth 1), or made an input of
    the op that did (depth 2; the producers list each depth-2 op after its depth-1 one)."""
    named = _DANGER.get(case.op)
    zeroed = [i for i in case.evidence.inputs if i.zeros and named in (None, i.name)]
    feeds: str | None = None
    for p in case.evidence.producers:
        if p.depth == 1:
            feeds = p.feeds
        fed = next((i for i in zeroed if i.name == feeds), None)
        if fed is not None and op_base(p.op) in GUARDS:
            yield p, fed


def _hit(case: Case, p: Producer, c: Constant, fed: TensorStats, dtype: str | None) -> Hit:
    held = _HELD.get(str(dtype), "1e-5")
    verb = _VERB.get(op_base(p.op), "floored at")
    if c.value == 0:  # NB: any dtype: an epsilon of 0 guards nothing (float64's too)
        below = ROUNDS_TO_ZERO.get(str(dtype))
        why = f" (an epsilon below ~{below:.1g} is 0 there)" if below else ""
        what = f"{c.words()}, which holds 0 in {dtype}{why}"
        at_line = f"{c.words()} holds 0 there"
    else:  # NB: `rounds_to_zero` held: the dtype is one of SMALLEST's
        smallest = SMALLEST[str(dtype)]
        what = f"{c.words()}, which is 0 in {dtype} (smallest value ~{smallest:.2g})"
        at_line = f"{c.words()} is 0 there"
    zeros = plural(fed.zeros, "exact zero")
    sentence = f"{p.op} at {p.source} {verb} {what}, so {case.first.op} still met {zeros}"
    # NB: the catalog's fix speaks of model.half() and Adam too; this run's epsilon is the
    # one at that line (an autocast run holds float32 weights already)
    compute = "compute that sum in float32" if verb == "added" else "compute it in float32"
    fix = (
        f"Use an epsilon {dtype} can hold at {p.source}: {at_line}; use {held} or more for "
        f"{dtype}, or {compute}: the epsilon then guards the denominator instead of vanishing."
    )
    return Hit(0.95, [sentence], fix=fix)


def _dtype_added_in(case: Case, p: Producer) -> str | None:
    """The dtype the producer computed in: that of the origin's input it made (depth 1),
    or of the origin's inputs that held the zeros (deeper), else the origin's own."""
    if p.depth == 1 and (fed := case.input(p.feeds)) is not None:
        return fed.dtype
    zeroed = [i.dtype for i in case.evidence.inputs if i.zeros]
    return zeroed[0] if zeroed else case.first.dtype


def _optimizer_eps(case: Case) -> Hit | None:
    eps, dtype, name = case.facts.eps, case.facts.param_dtype, case.facts.optimizer
    if eps is None or case.op not in ("div", "addcdiv", "sqrt", "add"):
        return None
    if eps == 0:
        sentence = (
            f"the optimizer {name} runs with eps=0: a parameter whose gradient is exactly 0 "
            f"gets 0/0 = NaN in {case.first.op}"
        )
        return Hit(0.9, [sentence], fix=_optimizer_fix(name, "eps=0 guards nothing", dtype))
    if rounds_to_zero(eps, dtype):
        sentence = f"the optimizer's eps={eps:g} is 0 in the {dtype} parameters' dtype"
        denominator = case.input(_DANGER.get(case.op, "")) or case.input("self")
        if denominator is not None and denominator.zeros:
            met = plural(denominator.zeros, "exact zero")
            sentence += f", so {case.first.op} divided by {met}"
        where = f"eps={eps:g} is 0 in {dtype}, the dtype of the parameters and of its state"
        return Hit(0.95, [sentence], fix=_optimizer_fix(name, where, dtype))
    return None


def _optimizer_fix(name: str, why: str, dtype: str) -> str:
    """Where the optimizer is built: an eps the dtype holds, or float32 weights and state.
    NB: 1e-4 is above float16's smallest normal number (6.1e-05), the eps the what-if
    replays with; a subnormal eps would hold, but divide by almost nothing."""
    held = "1e-4" if dtype == "float16" else _HELD.get(dtype, "1e-8")
    return (
        f"Give {name} an eps {dtype} holds where you build it (`eps={held}` or more): {why}, "
        "so a parameter whose gradient is 0 divides 0 by 0. Or keep the weights and the "
        "optimizer's state in float32 and run the math in float16 with autocast + "
        "GradScaler, instead of `model.half()`."
    )


FIXES = (
    Fix(change=Change.OPTIMIZER_EPS, phases=frozenset({"optimizer"})),
    Fix(patch=True),
    GUARD_ORIGIN,
)

CAUSE = CauseUnit(INFO, rule=eps_underflow, fixes=FIXES)
