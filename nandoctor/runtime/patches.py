"""Math patches: probes that change the math for a what-if replay, without touching the
user's code. Each is a `TorchFunctionMode` entered for the whole replay; `hits` counts the
calls it rewrote, so a patch that found nothing to rewrite is not mistaken for a fix.

Each is registered in `PATCHES` under the cause id whose fix it is (a cause's fix plan asks
for it with `Fix(patch=True)`; diagnose/verify.py looks it up here), once:

- `log-of-softmax`, `LogSoftmaxPatch`: `log(softmax(x))` becomes `log_softmax(x)`.
- `fully-masked-softmax`, `FiniteMaskPatch`: `masked_fill(mask, -inf)` fills with the
  dtype's finite minimum.
- `eps-underflow`, `EpsilonPatch`: an epsilon the dtype rounds to 0 (`x + 1e-8` in float16,
  `eps=1e-8` of a norm) is raised to the dtype's smallest normal number.

The ids are plain strings here: the runtime sits below the causes and does not import them;
tests/test_whatif.py checks that every id is a cause whose fix plan uses the patch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from nandoctor.registry import Registry
from nandoctor.runtime.probe import Probe

_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}
_LOG = {torch.log, torch.Tensor.log}
_MASKED_FILL = {torch.masked_fill, torch.Tensor.masked_fill, torch.Tensor.masked_fill_}
_ADD = {torch.add, torch.Tensor.add, torch.Tensor.add_}
_ADD |= {torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__iadd__}
_NORMS = {F.layer_norm, F.group_norm, F.batch_norm, F.instance_norm}
if hasattr(F, "rms_norm"):
    _NORMS.add(F.rms_norm)


class MathPatch(Probe, TorchFunctionMode):
    """A probe whose lifetime is a `TorchFunctionMode`'s; `describe` completes "with ..."."""

    describe = ""

    def __init__(self) -> None:
        TorchFunctionMode.__init__(self)
        self.hits = 0

    def __enter__(self) -> MathPatch:
        TorchFunctionMode.__enter__(self)
        return self

    def __exit__(self, *exc: object) -> None:
        TorchFunctionMode.__exit__(self, *exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.rewrite(func, args, kwargs or {})

    def rewrite(self, func: Any, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)


P = TypeVar("P", bound=type[MathPatch])
PATCHES: Registry[type[MathPatch]] = Registry("math patch")


def patch_for(cause_id: str) -> Callable[[P], P]:
    """Register a patch class as the math fix of `cause_id`; a second one for it raises."""

    def register(cls: P) -> P:
        PATCHES.add(cause_id, cls, by=f"{cls.__module__}.{cls.__qualname__}")
        return cls

    return register


@patch_for("log-of-softmax")
class LogSoftmaxPatch(MathPatch):
    describe = "log_softmax(x) substituted for log(softmax(x))"

    def __init__(self) -> None:
        super().__init__()
        self._softmax_of: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def rewrite(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _LOG and args and args[0] in self._softmax_of:
            x, dim = self._softmax_of[args[0]]
            self.hits += 1
            return F.log_softmax(x, dim=dim)
        out = func(*args, **kwargs)
        if func in _SOFTMAX and isinstance(out, torch.Tensor):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            self._softmax_of[out] = (args[0], dim)
        return out


@patch_for("fully-masked-softmax")
class FiniteMaskPatch(MathPatch):
    describe = "masks filled with the dtype's finite minimum instead of -inf"

    def rewrite(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _MASKED_FILL and len(args) >= 3 and _is_neg_inf(args[2]):
            self.hits += 1
            args = (*args[:2], torch.finfo(args[0].dtype).min, *args[3:])
        return func(*args, **kwargs)


@patch_for("eps-underflow")
class EpsilonPatch(MathPatch):
    describe = "epsilons raised to what the dtype can hold"

    def rewrite(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in _ADD and len(args) == 2:
            tensor, scalar = (
                (args[0], args[1]) if isinstance(args[0], torch.Tensor) else (args[1], args[0])
            )
            if isinstance(tensor, torch.Tensor) and _too_small(scalar, tensor.dtype):
                self.hits += 1
                raised = torch.finfo(tensor.dtype).tiny
                args = (tensor, raised) if args[0] is tensor else (raised, tensor)
        elif func in _NORMS and (dtype := _dtype(args)) and _too_small(kwargs.get("eps"), dtype):
            self.hits += 1
            kwargs = {**kwargs, "eps": torch.finfo(dtype).tiny}
        return func(*args, **kwargs)


def _is_neg_inf(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.isneginf().all())
    return isinstance(value, float) and value == float("-inf")


def _too_small(value: Any, dtype: torch.dtype | None) -> bool:
    """A nonzero number that `dtype` rounds to exactly 0 (1e-8 in float16)."""
    if dtype is None or not isinstance(value, float) or not dtype.is_floating_point or value == 0:
        return False
    return float(torch.tensor(value, dtype=dtype)) == 0.0


def _dtype(args: tuple) -> torch.dtype | None:
    return args[0].dtype if args and isinstance(args[0], torch.Tensor) else None
