"""The safe form of one op, for the "guard the origin op" what-if (patches.OriginGuardPatch).

An op is known by its family, the name the report and torch's Python API share once the
namespaces, in-place underscores and dunders are peeled off: `aten.div.Tensor`,
`torch.Tensor.div_` and `x / y` are all "div". Each family has one way of being made safe,
chosen so that the value *and* its gradient stay finite, the way a user would fix it:

| kind | families | the safe form |
|---|---|---|
| denominator | div, `x / y` | the denominator moved away from 0 (|d| >= the dtype's eps) |
| self away from 0 | reciprocal, `2 / x` | the input moved away from 0 |
| floor | log, log2, log10, sqrt, rsqrt | the input clamped to the dtype's smallest normal |
| above -1 | log1p | the input clamped to -1 + eps |
| unit | acos, asin, atanh | the input clamped into [-1 + eps, 1 - eps] |
| other floored | xlogy, x * log(y) | y clamped to the dtype's smallest normal (x / y: 0/0) |
| pow | pow, `x ** p` | a root (0 < p < 1): floor; a negative power: away from 0; else float32 |
| mean over none | cross_entropy, nll_loss (means) | their sum over the targets counted (>= 1) |
| float32 | exp, matmul, linear, any other op | run in float32, autocast off |

An exp of one learnable value (CLIP's `logit_scale.exp()`) is capped instead: float32 bounds
no exponent that grows past 88.7 (`capped_scale`).

The clamps are differentiable (a clamped entry gets a zero gradient, never inf * 0), so the
backward of a guarded sqrt at 0 is as finite as its forward. Nothing here knows about
causes or reports.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

import torch


class SafeForm(str, Enum):
    DENOMINATOR = "denominator moved away from 0"
    SELF_AWAY = "input moved away from 0"
    FLOOR = "input clamped to the smallest normal number"
    ABOVE_MINUS_ONE = "input clamped above -1"
    UNIT = "input clamped into (-1, 1)"
    POW = "base kept in the power's domain"
    OTHER_FLOOR = "second input clamped to the smallest normal number"
    MEAN_OVER_NONE = "a mean over no target taken as 0"
    FLOAT32 = "run in float32"


# name -> (family, kind); a name not listed is its own family, run in float32
_TABLE: dict[str, tuple[str, SafeForm]] = {
    **dict.fromkeys(
        ("div", "divide", "true_divide", "__truediv__", "__itruediv__"),
        ("div", SafeForm.DENOMINATOR),
    ),
    **dict.fromkeys(("__rtruediv__", "reciprocal"), ("div", SafeForm.SELF_AWAY)),
    **{name: (name, SafeForm.FLOOR) for name in ("log", "log2", "log10", "sqrt", "rsqrt")},
    "log1p": ("log1p", SafeForm.ABOVE_MINUS_ONE),
    **dict.fromkeys(("acos", "arccos"), ("acos", SafeForm.UNIT)),
    **dict.fromkeys(("asin", "arcsin"), ("asin", SafeForm.UNIT)),
    **dict.fromkeys(("atanh", "arctanh"), ("atanh", SafeForm.UNIT)),
    "xlogy": ("xlogy", SafeForm.OTHER_FLOOR),
    **dict.fromkeys(("pow", "__pow__", "__ipow__", "float_power"), ("pow", SafeForm.POW)),
    "__rpow__": ("pow", SafeForm.FLOAT32),
    **dict.fromkeys(
        ("mm", "bmm", "addmm", "matmul", "__matmul__", "linear", "baddbmm", "addbmm"),
        ("matmul", SafeForm.FLOAT32),
    ),
    # NB: aten's names (the report's op) and the Python calls the guard meets (F.cross_entropy
    # is log_softmax then nll_loss; a library calls it, not aten's op)
    **dict.fromkeys(
        ("cross_entropy", "nll_loss", "nll_loss_forward", "nll_loss2d_forward", "nll_loss_nd"),
        ("nll_loss", SafeForm.MEAN_OVER_NONE),
    ),
}
_OVERFLOWING = frozenset({"exp", "exp2", "expm1", "pow"})  # float32 guards them in any case
# A learnable scale that an exp reads (CLIP's `logit_scale.exp()`) is capped where CLIP's
# training caps it, at a scale of 100: float32 bounds no exponent that grows past 88.7
SCALE_CAP = math.log(100.0)
SCALE_CAPPED = "its learnable scale capped at ln(100), as CLIP caps its logit scale"


def base_name(name: str) -> str:
    """The op's own name: "aten.div_.Tensor" -> "div_", "torch.Tensor.sqrt" -> "sqrt",
    "torch.nn.functional.linear" -> "linear", "aten._softmax.default" -> "_softmax"."""
    if name.startswith("aten."):
        parts = name.split(".")
        return parts[1] if len(parts) > 1 else name
    return name.rsplit(".", 1)[-1]


def family(name: str) -> tuple[str, SafeForm]:
    """The family and the safe form of an op named as the report or torch's API names it."""
    base = base_name(name)
    if not base.startswith("__"):
        base = base.strip("_")
    return _TABLE.get(base, (base, SafeForm.FLOAT32))


def guards_float32(fam: str, overflowed: bool) -> bool:
    """Running in float32 is the guard of an op that overflowed, or of exp and pow; for any
    other op (a NaN out of std's backward, say) float32 would change nothing."""
    return overflowed or fam in _OVERFLOWING


def in_place(name: str) -> bool:
    base = base_name(name)
    return base.startswith("__i") or (base.endswith("_") and not base.endswith("__"))


def safe_call(func: Callable, name: str, args: tuple, kwargs: dict) -> Any:
    """Call `func` (whose family is `name`'s) in its safe form."""
    _, kind = family(name)
    if kind is SafeForm.POW:
        kind = _pow_kind(args, kwargs)
    if kind is SafeForm.FLOAT32:
        return in_float32(func, args, kwargs)
    if kind is SafeForm.MEAN_OVER_NONE:
        return mean_over_some(func, args, kwargs)
    if kind in _SECOND:
        second = _SECOND[kind]
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            args = (args[0], second(args[1]), *args[2:])
        elif isinstance(kwargs.get("other"), torch.Tensor):
            kwargs = {**kwargs, "other": second(kwargs["other"])}
        return func(*args, **kwargs)
    x = args[0]
    safe = _SAFE[kind](x, in_place(name))
    return func(safe, *args[1:], **kwargs)


def is_scale(x: Any) -> bool:
    """A learnable scale: one value that training moves (a 0-dim parameter, or a view of
    one), which an exp turns into a factor."""
    return isinstance(x, torch.Tensor) and x.numel() == 1 and x.requires_grad


def capped_scale(func: Callable, args: tuple, kwargs: dict) -> Any:
    """exp of the learnable scale `args[0]` clamped at SCALE_CAP (differentiable: above the
    cap it gets no gradient, as `logit_scale.clamp(max=math.log(100)).exp()`)."""
    return func(args[0].clamp(max=SCALE_CAP), *args[1:], **kwargs)


def mean_over_some(func: Callable, args: tuple, kwargs: dict) -> Any:
    """A loss's mean over the targets it counts (not `ignore_index`; weighted by `weight`)
    as its sum divided by that count held at 1 or more: a batch with no target to count (a
    masked-LM batch with no masked token) gives 0 and zero gradients, not 0/0; any other
    batch, the loss as it was. Called as written where it is not a mean over class
    indices (another reduction, or probabilities as targets)."""
    try:
        bound = inspect.signature(func).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return func(*args, **kwargs)
    target, weight = bound.get("target"), bound.get("weight")
    legacy = bound.get("size_average") is not None or bound.get("reduce") is not None
    mean = bound.get("reduction", "mean") == "mean" and not legacy
    if not mean or not isinstance(target, torch.Tensor) or target.is_floating_point():
        return func(*args, **kwargs)
    counted = target != bound.get("ignore_index", -100)
    if isinstance(weight, torch.Tensor):
        count = (weight[torch.where(counted, target, 0)] * counted).sum()
    else:
        count = counted.sum()
    total = func(**{**bound, "reduction": "sum"})
    return total / count.clamp_min(1).to(total.dtype)


def away_from_zero(d: torch.Tensor) -> torch.Tensor:
    """`d` with every entry closer to 0 than the dtype's eps moved out to +-eps (its sign
    kept, +eps for 0): x / d is then at most x / eps, and so is its gradient."""
    if not d.is_floating_point():
        return d
    eps = torch.finfo(d.dtype).eps
    out = torch.where(d < 0, -eps, eps).to(d.dtype)
    return torch.where(d.abs() < eps, out, d)


def _floor(x: torch.Tensor, inplace: bool) -> torch.Tensor:
    tiny = torch.finfo(x.dtype).tiny
    return x.clamp_min_(tiny) if inplace else x.clamp_min(tiny)


def _above_minus_one(x: torch.Tensor, inplace: bool) -> torch.Tensor:
    low = -1 + torch.finfo(x.dtype).eps
    return x.clamp_min_(low) if inplace else x.clamp_min(low)


def _unit(x: torch.Tensor, inplace: bool) -> torch.Tensor:
    eps = torch.finfo(x.dtype).eps
    return x.clamp_(-1 + eps, 1 - eps) if inplace else x.clamp(-1 + eps, 1 - eps)


def _self_away(x: torch.Tensor, inplace: bool) -> torch.Tensor:
    return x.copy_(away_from_zero(x)) if inplace else away_from_zero(x)


# NB: the kinds whose safe form changes the second input (`other`), never in place
_SECOND: dict[SafeForm, Callable[[torch.Tensor], torch.Tensor]] = {
    SafeForm.DENOMINATOR: away_from_zero,
    SafeForm.OTHER_FLOOR: lambda y: _floor(y, False) if y.is_floating_point() else y,
}

_SAFE: dict[SafeForm, Callable[[torch.Tensor, bool], torch.Tensor]] = {
    SafeForm.FLOOR: _floor,
    SafeForm.ABOVE_MINUS_ONE: _above_minus_one,
    SafeForm.UNIT: _unit,
    SafeForm.SELF_AWAY: _self_away,
}


def _pow_kind(args: tuple, kwargs: dict) -> SafeForm:
    """x ** p: a root floors x, a negative power keeps x away from 0; p >= 1: float32."""
    p = args[1] if len(args) > 1 else kwargs.get("exponent")
    if not isinstance(p, (int, float)) or p >= 1 or p == 0:
        return SafeForm.FLOAT32
    if p < 0 and float(p).is_integer():
        return SafeForm.SELF_AWAY
    return SafeForm.FLOOR


def in_float32(func: Callable, args: tuple, kwargs: dict) -> Any:
    """`func` on float32 copies of its half-precision inputs, with autocast off."""
    with _no_autocast():
        return func(*_upcast(args), **_upcast(kwargs))


def _upcast(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.float() if obj.dtype in (torch.float16, torch.bfloat16) else obj
    if isinstance(obj, tuple):
        return tuple(_upcast(x) for x in obj)
    if isinstance(obj, list):
        return [_upcast(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _upcast(v) for k, v in obj.items()}
    return obj


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if torch.cuda.is_available():
            stack.enter_context(torch.autocast("cuda", enabled=False))
        yield
