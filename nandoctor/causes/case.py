"""A `Case`: everything the diagnosis rules may read about one failure, as plain data.

The report's `first_nonfinite` and `evidence` (what the replay saw), the telemetry trends,
the run's settings (`RunFacts`) and, for a collapse of the GradScaler's scale, the
verdict's account of it (`Collapse`). Helpers name ops the way the rules think of them:
`aten._softmax.default` is "softmax", `aten._foreach_addcdiv_.ScalarList` is "addcdiv".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NB: annotations only: `lint` loads the causes for their texts, and
    # the report's model (its health statistics, JSON) is a fifth of its start-up
    from nandoctor.report.evidence import Evidence, Producer, TensorStats
    from nandoctor.report.trends import Trends
    from nandoctor.report.types import FirstNonfinite, Transient

FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST = 2.0**-24  # ~6e-8, the smallest positive float16 (a subnormal)
FLOAT16_ROUNDS_TO_ZERO = 2.0**-25  # anything smaller in magnitude is 0 in float16

# Per dtype, the smallest positive value (a subnormal) and the magnitude at or below which
# a number rounds to exactly 0 there (half of that value: round-to-nearest-even)
SMALLEST = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149}
ROUNDS_TO_ZERO = {dtype: smallest / 2 for dtype, smallest in SMALLEST.items()}


def rounds_to_zero(x: float, dtype: str | None) -> bool:
    """A nonzero number that `dtype` holds as exactly 0 (1e-8 in float16; 1e-50 in float32)."""
    limit = ROUNDS_TO_ZERO.get(dtype or "")
    return limit is not None and 0 < abs(x) <= limit


@dataclass(frozen=True)
class LrJump:
    """A step at which the learning rate in effect was multiplied (by a scheduler)."""

    step: int
    before: float
    after: float

    @property
    def factor(self) -> float:
        return self.after / self.before if self.before else float("inf")


@dataclass(frozen=True)
class RunFacts:
    """The run's settings that bear on a diagnosis."""

    dtype: str
    grad_scaler: bool
    clip_grad_norm: float | None
    optimizer: str
    lr: float | None
    eps: float | None
    param_dtype: str
    checkpoint: str | None = None
    start_step: int = 0
    # `lr` is the rate in effect at the failing step (the optimizer's param_groups[0]);
    # `lr_start` the one the run started with, `lr_jump` the largest jump between them,
    # `scheduler` the scheduler's class, when the run had one
    lr_start: float | None = None
    lr_jump: LrJump | None = None
    scheduler: str | None = None
    # the rate the user set, which a scheduler scales (its `initial_lr`); None without one
    lr_base: float | None = None
    # the first step whose clip met gradients still carrying the loss scale (a loop that
    # clips before `scaler.unscale_`, seen by the hooks); None when none did
    clipped_scaled: int | None = None


@dataclass(frozen=True)
class Collapse:
    """The failure was a streak of GradScaler skips that collapsed the scale, as the
    sentinel's verdict says it (`why`). `unchecked`: no rerun could recheck its skips at
    loss scale 1 (Guard's `with` form): a NaN the scaler hid collapses the scale as an
    overflow does."""

    why: str
    unchecked: bool = False


@dataclass(frozen=True)
class Case:
    first: FirstNonfinite
    evidence: Evidence
    trends: Trends
    facts: RunFacts
    # the original run's (step, loss) before the failing step, which a what-if replay's
    # losses are measured against: a fix must not stop the run learning
    losses: tuple[tuple[int, float], ...] = ()
    # the non-finite values the replay saw heal before the failure (report.transients)
    transients: tuple[Transient, ...] = ()
    # the run's loss at the failing step, as the run recorded it (None: not recorded)
    failing_loss: float | None = None
    # the failure was a collapse of the GradScaler's scale (read from the verdict)
    collapse: Collapse | None = None

    @property
    def op(self) -> str:
        return op_base(self.first.op)

    @property
    def diverged_since(self) -> int | None:
        """The step from which the loss diverged, before or with the gradients, for at
        least MIN_RISE_STEPS steps before the failure: a failure that divergence led to
        (a rate too high), whatever op it reached first; None otherwise."""
        t = self.trends
        onset = t.loss_onset
        led = onset is not None and (t.grad_onset is None or onset <= t.grad_onset)
        if onset is None or not led or self.first.step - onset < MIN_RISE_STEPS:
            return None
        return onset

    @property
    def climbed_since(self) -> int | None:
        """The step of the loss's best, from which it climbed back (at least 2x, still
        rising) for at least MIN_RISE_STEPS steps before the failure; None otherwise."""
        t = self.trends
        best = t.loss_min_step
        rising = (t.loss_rise or 0) >= 2 and (t.loss_late_slope or 0) > 0
        if best is None or not rising or self.first.step - best < MIN_RISE_STEPS:
            return None
        return best

    @property
    def backward_of(self) -> str:
        """The forward function whose backward failed: "sqrt" for "torch.sqrt (SqrtBackward0)"."""
        text = self.evidence.backward_of or ""
        name = text.split(" ")[0].rsplit(".", 1)[-1]
        return _DUNDER.get(name, name.strip("_"))

    @property
    def created_nan(self) -> bool:
        out = self.evidence.output
        return out is not None and out.nan > 0 and not any(i.nan for i in self.evidence.inputs)

    def input(self, name: str) -> TensorStats | None:
        return next((i for i in self.evidence.inputs if i.name == name), None)

    @property
    def divisor(self) -> TensorStats | None:
        """What a division divided by (div's `other`, reciprocal's `self`); None for an
        op that divides nothing."""
        name = {"div": "other", "reciprocal": "self"}.get(self.op)
        return self.input(name) if name is not None else None

    def producers(self, depth: int = 1, feeds: str | None = None) -> list[Producer]:
        return [
            p
            for p in self.evidence.producers
            if p.depth == depth and (feeds is None or p.feeds == feeds)
        ]

    def made_by(
        self, ops: frozenset[str], depth: int = 1, feeds: str | None = None
    ) -> Producer | None:
        return next((p for p in self.producers(depth, feeds) if op_base(p.op) in ops), None)

    @property
    def zeros_in_inputs(self) -> int:
        return sum(i.zeros for i in self.evidence.inputs)


MIN_RISE_STEPS = 5  # a loss rise counts when it lasted this many steps: more than a blip

_DUNDER = {"__truediv__": "div", "__rtruediv__": "div", "__pow__": "pow", "__rpow__": "pow"}


def op_base(op: str | None) -> str:
    """`aten._foreach_addcdiv_.ScalarList` -> "addcdiv"; `aten._softmax.default` -> "softmax"."""
    if not op:
        return ""
    name = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 1 else op
    name = name.removeprefix("_foreach_").strip("_")
    return name.removeprefix("safe_")
