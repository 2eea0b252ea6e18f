"""Evidence: plain data about what the instrumented replay saw at the bad step.

The tracer fills it, the report carries it (under "evidence"), the diagnosis rules read
it. No torch types here: numbers, strings and lists, so that JSON is a plain dump.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorStats:
    """What a tensor held; extremes are over its finite values only."""

    name: str  # the argument's name in the op's schema ("self", "other") or a path
    dtype: str
    shape: list[int]
    numel: int
    absmax: float  # largest finite |x|
    min: float
    max: float
    zeros: int
    negatives: int
    nan: int
    posinf: int
    neginf: int
    dtype_max: float | None  # the dtype's largest finite value (65504 for float16)

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    @property
    def fraction_of_dtype_max(self) -> float | None:
        return self.absmax / self.dtype_max if self.dtype_max else None


@dataclass(frozen=True)
class Producer:
    """An op that made one of the origin op's inputs, one or two levels back."""

    op: str
    module: str | None
    source: str | None
    phase: str
    depth: int  # 1: made an input of the origin op; 2: made an input of that producer
    feeds: str  # which input of its consumer it made ("self", "other", ...)
    scalars: list[str] = field(default_factory=list)  # its plain-number arguments: "other=1e-08"


@dataclass(frozen=True)
class Recompute:
    """The origin op run again in float32 on the same inputs (upcast)."""

    dtype: str
    finite: bool
    absmax: float | None
    error: str | None = None


@dataclass(frozen=True)
class ModuleStat:
    """A module's largest activation and gradient magnitudes during the replayed step."""

    module: str  # path as in named_modules(); "" is the root
    type: str
    dtype: str | None
    activation_absmax: float | None
    activation_nonfinite: bool = False
    gradient_absmax: float | None = None
    gradient_nonfinite: bool = False


@dataclass(frozen=True)
class UpdateRatio:
    """How far one optimizer step moved the weights: ||w_after - w_before|| / ||w_before||.

    Around 1e-3 is a healthy step; the learning-rate rule counts 3% and above as large."""

    step: int
    ratio: float  # over all parameters together
    largest: float  # the largest ratio of a single parameter
    largest_param: str


@dataclass(frozen=True)
class Evidence:
    inputs: list[TensorStats] = field(default_factory=list)  # the origin op's tensor inputs
    output: TensorStats | None = None  # the origin op's non-finite output
    scalars: list[str] = field(default_factory=list)  # its non-tensor arguments, as text
    backward_of: str | None = None  # in backward: the forward function whose gradient ran
    producers: list[Producer] = field(default_factory=list)
    recompute: Recompute | None = None
    modules: list[ModuleStat] = field(default_factory=list)  # largest activations first
    update: UpdateRatio | None = None  # of the step before the bad one, when replayable
    replayed_from_step: int | None = None  # the snapshot the replay started from
