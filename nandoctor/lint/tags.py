"""The facts the data flow attaches to a value: `probs` holds a softmax output, `mask` a
-inf fill, `EPS` the constant 1e-8. See `flow` for how they travel."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from nandoctor.lint.index import Located


class Kind(Enum):
    SOFTMAX = "softmax output"
    SOFTMAX_EPS = "softmax output plus an epsilon"
    SOFTMAX_MODULE = "nn.Softmax module"
    SIGMOID_MODULE = "nn.Sigmoid module"
    SIGMOID = "sigmoid output: a probability that rounds to exactly 0 for z below ~-17"
    COMPLEMENT = "one minus a sigmoid: exactly 0 once the sigmoid rounds to 1"
    NEG_INF = "-inf fill"
    EXP = "positive: exp or a sum of exp"
    POSITIVE = "positive: sigmoid, softplus or a sum of them"
    SQUARES = "squares, a sum of squares or a variance"
    ZEROABLE = "sum, norm or std: 0 for all-zero input"
    EPS_ADDED = "plus a small constant"
    CLAMPED = "clamped"
    FLOAT32 = "cast to float32 by the code itself (`.float()`): float32 even under autocast"
    CONST = "numeric constant"
    FLOAT16 = "the float16 dtype, or a choice of dtypes that includes it (a dict, an if/else)"


@dataclass(frozen=True)
class Tag:
    kind: Kind
    origin: Located  # the node that produced the value (a softmax call, a masked_fill...)
    value: float | None = None  # CONST, EPS_ADDED, SOFTMAX_EPS: the constant, when known


Tags = frozenset[Tag]
NONE: Tags = frozenset()


def keep(tags: Iterable[Tag], kinds: Iterable[Kind]) -> Tags:
    wanted = set(kinds)
    return frozenset(t for t in tags if t.kind in wanted)


def kinds(tags: Iterable[Tag]) -> set[Kind]:
    return {t.kind for t in tags}
