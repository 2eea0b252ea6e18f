"""Math patches: probes that change the math for a what-if replay, without touching the
user's code. Each is a `TorchFunctionMode` entered for the whole replay; `hits` counts the
calls it rewrote, so a patch that found nothing to rewrite is not mistaken for a fix.

Each is registered in `PATCHES` under the cause id whose fix it is (a cause's fix plan asks
for it with `Fix(patch=True)`; diagnose/plans.py looks it up here), once:

- `log-of-softmax`, `LogSoftmaxPatch`: `log(softmax(x))` becomes `log_softmax(x)`.
- `fully-masked-softmax`, `FiniteMaskPatch`: `masked_fill(mask, -inf)` fills with the
  dtype's finite minimum.
- `eps-underflow`, `EpsilonPatch`: an epsilon the dtype rounds to 0 (`x + 1e-8` in float16,
  `clamp(min=1e-8)`, `eps=1e-8` of a norm) is raised to the dtype's smallest normal number.

The ids are plain strings here: the runtime sits below the causes and does not import them;
tests/diagnose/test_verify.py checks that every id is a cause whose fix plan uses the patch.

One patch serves many causes and is not registered by id: `OriginGuardPatch`, "guard the
origin op", made for one failure from the op and the user's source line the replay named
(`OpSite`). Only that op, called from that line, is made safe (safe_ops.py: a denominator
moved away from 0, a log or sqrt input clamped to the smallest normal, acos/asin clamped
into the domain, exp, pow, a matmul or a custom autograd Function run in float32); every
other call runs as written.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils.weak import WeakIdKeyDictionary

from nandoctor.registry import Registry
from nandoctor.runtime import epsilons, safe_ops, wrappers
from nandoctor.runtime.probe import Probe
from nandoctor.user_files import is_nandoctor_file, is_user_file

_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.nn.functional.softmax}
_LOG = {torch.log, torch.Tensor.log}
_MASKED_FILL = {torch.masked_fill, torch.Tensor.masked_fill, torch.Tensor.masked_fill_}
_ADD = {torch.add, torch.Tensor.add, torch.Tensor.add_}
_ADD |= {torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__iadd__}
_CLAMP = {torch.clamp, torch.clamp_min, torch.Tensor.clamp, torch.Tensor.clamp_min}
_CLAMP |= {torch.Tensor.clamp_, torch.Tensor.clamp_min_, torch.clip, torch.Tensor.clip}
_MAXIMUM = {torch.maximum, torch.Tensor.maximum, torch.fmax, torch.Tensor.fmax}
_MAXIMUM |= {torch.max, torch.Tensor.max}  # NB: with two tensors; `max(x, dim)` has an int
# NB: where each fill's value is among its arguments
_FILLS = {torch.full_like: 1, torch.Tensor.new_full: 2, torch.where: 2, torch.Tensor.where: 2}
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
        # NB: torch hands a mode a `Tensor` method as it finds it there: nandoctor's own
        # wrapper while the forecast listens (`runtime.wrappers`), or a user's made with
        # `functools.wraps`; each patch knows torch's own callables
        return self.rewrite(getattr(func, "__wrapped__", func), args, kwargs or {})

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
        # NB: only a softmax the user wrote: one inside a library (transformers' attention,
        # whose probabilities the user's loss takes the log of) has no logits the user
        # could pass to log_softmax; the guard of the log is then the fix to replay
        if func in _SOFTMAX and isinstance(out, torch.Tensor) and _called_by_user(sys._getframe()):
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
    """Raise each epsilon the dtype rounds to 0 (runtime/epsilons.py), however it is given:
    a number or a constant tensor added, a clamp's or a maximum's floor, a norm's `eps`, a
    fill (`full_like(n, 1e-8)`, `where(c, n, 1e-8)`)."""

    describe = "epsilons raised to what the dtype can hold"

    def rewrite(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if (func in _ADD or func in _MAXIMUM) and len(args) == 2:
            args = self._raised_operand(args)
        elif func in _NORMS and (dtype := _dtype(args)):
            if (eps := epsilons.raised(kwargs.get("eps"), dtype)) is not None:
                self.hits += 1
                kwargs = {**kwargs, "eps": eps}
        elif func in _CLAMP and (dtype := _dtype(args)):
            args, kwargs = self._raised_min(args, kwargs, dtype)
        elif func in _FILLS:
            args, kwargs = self._raised_fill(func, args, kwargs)
        return func(*args, **kwargs)

    def _raised_operand(self, args: tuple) -> tuple:
        """`x + eps` or `maximum(x, eps)`: the operand the op's dtype rounds to 0 raised."""
        dtype = epsilons.result_dtype(*args)
        for i in (1, 0):
            if (eps := epsilons.raised(args[i], dtype)) is not None:
                self.hits += 1
                return (args[0], eps) if i else (eps, args[1])
        return args

    def _raised_min(self, args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
        """`clamp(x, min=1e-8)` in float16 clamps to 0: raise the minimum it rounds to 0."""
        low = args[1] if len(args) > 1 else kwargs.get("min")
        eps = epsilons.raised(low, dtype)
        if eps is None:
            return args, kwargs
        self.hits += 1
        if len(args) > 1:
            return (args[0], eps, *args[2:]), kwargs
        return args, {**kwargs, "min": eps}

    def _raised_fill(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """`full_like(n, 1e-8)` or `where(c, n, 1e-8)` in float16: a tensor of zeros."""
        at = _FILLS[func]
        if len(args) <= at or isinstance(args[at], torch.Tensor):
            return args, kwargs
        floats = (a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
        like = next(floats, None)
        dtype = kwargs.get("dtype") or (like.dtype if like is not None else None)
        if (eps := epsilons.raised(args[at], dtype)) is None:
            return args, kwargs
        self.hits += 1
        return (*args[:at], eps, *args[at + 1 :]), kwargs


@dataclass(frozen=True)
class OpSite:
    """The op to guard and where it was issued: `family` as safe_ops names it ("div",
    "sqrt", "matmul"), and `file` and `line`: the innermost frame of the user's code
    (`file` absolute), or, for an op inside a library (`library`: a transformers modeling
    file), that library's line (`file` then as the report shows it, from the package:
    "transformers/models/gpt2/modeling_gpt2.py"), so that only that op is guarded and not
    every op of its family the user's `model(...)` line runs. `overflowed`: running it in
    float32 is then a guard. `scale`: the op is an exp of one value (a learnable scale,
    CLIP's `logit_scale.exp()`), which the guard caps (`safe_ops.capped_scale`)."""

    family: str
    file: str
    line: int
    overflowed: bool = False
    library: bool = False
    scale: bool = False


class OriginGuardPatch(MathPatch):
    """Guard the origin op: the op of `site`'s family, called from `site`'s line, runs in
    its safe form (safe_ops.py); so does a custom autograd Function applied from that line,
    in float32, where float32 is the guard (`wrappers.guard_applies`). `hits` counts the
    calls guarded."""

    def __init__(self, site: OpSite) -> None:
        super().__init__()
        self.site = site
        self.float32 = safe_ops.guards_float32(site.family, site.overflowed)
        name = os.path.basename(site.file)
        self.describe = f"the {site.family} at {name}:{site.line} guarded ({self._how()})"

    def _how(self) -> str:
        if self.site.scale:
            return safe_ops.SCALE_CAPPED
        kind = safe_ops.family(self.site.family)[1]
        return safe_ops.SafeForm.FLOAT32.value if kind is safe_ops.SafeForm.POW else kind.value

    def __enter__(self) -> OriginGuardPatch:
        super().__enter__()
        if self.float32:
            wrappers.guard_applies(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.float32:
            wrappers.stop_guarding_applies(self)
        super().__exit__(*exc)

    def rewrite(self, func: Any, args: tuple, kwargs: dict) -> Any:
        name = _name(func)
        fam, kind = safe_ops.family(name)
        if fam != self.site.family or not self._at_site():
            return func(*args, **kwargs)
        if self.site.scale and args and safe_ops.is_scale(args[0]):
            self.hits += 1
            return safe_ops.capped_scale(func, args, kwargs)
        if kind is safe_ops.SafeForm.FLOAT32 and not self.float32:
            return func(*args, **kwargs)
        if kind is safe_ops.SafeForm.FLOAT32 and safe_ops.in_place(name):
            return func(*args, **kwargs)  # NB: a float32 result cannot be written in place
        self.hits += 1
        return safe_ops.safe_call(func, name, args, kwargs)

    def guard_apply(self, apply: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
        if not self._at_site():
            return apply(cls, *args, **kwargs)
        self.hits += 1
        return safe_ops.in_float32(functools.partial(apply, cls), args, kwargs)

    def _at_site(self) -> bool:
        if self.site.library:
            return _through(sys._getframe(1), self.site.file, self.site.line)
        here = _user_line(sys._getframe(1))
        return here is not None and here == (self.site.file, self.site.line)


def _is_neg_inf(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(value.isneginf().all())
    return isinstance(value, float) and value == float("-inf")


def _user_line(frame: FrameType | None) -> tuple[str, int] | None:
    """(absolute file, line) of the innermost frame of the user's code above `frame`; None
    when nandoctor's own loop comes first (an op of the optimizer or the scaler)."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            return _absolute(filename), frame.f_lineno
        if is_nandoctor_file(filename) and not _passed_over(frame):
            return None
        frame = frame.f_back
    return None


def _called_by_user(frame: FrameType | None) -> bool:
    """The call was written in the user's code, not inside a library the user's code
    calls (torch's own frames and nandoctor's patches passed over)."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if is_user_file(filename):
            return True
        if not _passed_over(frame) and not _absolute(filename).startswith(_TORCH_DIR):
            return False
        frame = frame.f_back
    return False


def _through(frame: FrameType | None, shown: str, line: int) -> bool:
    """Was the call made from library file `shown` (as the report shows it) at `line`,
    on its way from the user's code?"""
    while frame is not None:
        filename = frame.f_code.co_filename
        if frame.f_lineno == line and _shown_as(filename, shown):
            return True
        if is_user_file(filename):
            return False
        if is_nandoctor_file(filename) and not _passed_over(frame):
            return False
        frame = frame.f_back
    return False


def _passed_over(frame: FrameType) -> bool:
    """A frame of nandoctor's on the way from the user's line to the op: this module's,
    the safe ops', or the wrapper that brings a custom Function's `apply` to the guard."""
    return _absolute(frame.f_code.co_filename) in _OWN_FILES or wrappers.passes_through(frame)


@functools.lru_cache(maxsize=4096)
def _shown_as(filename: str, shown: str) -> bool:
    return ("/" + _absolute(filename).replace(os.sep, "/")).endswith("/" + shown)


@functools.lru_cache(maxsize=4096)
def _absolute(filename: str) -> str:
    return os.path.realpath(filename)


_OWN_FILES = frozenset({_absolute(__file__), _absolute(safe_ops.__file__)})
_TORCH_DIR = os.path.dirname(_absolute(torch.__file__)) + os.sep
_NAMES: dict[Any, str] = {}


def _name(func: Any) -> str:
    """torch's name of a function the mode saw ("torch.Tensor.div"), looked up once."""
    try:
        return _NAMES[func]
    except KeyError:
        name = _NAMES[func] = resolve_name(func) or getattr(func, "__name__", "")
        return name
    except TypeError:  # NB: an unhashable callable
        return resolve_name(func) or getattr(func, "__name__", "")


def _dtype(args: tuple) -> torch.dtype | None:
    return args[0].dtype if args and isinstance(args[0], torch.Tensor) else None
