"""CUDA's autocast policy on the CPU: the replay of a GPU job computes each op in the dtype
CUDA autocast would.

CPU autocast casts far fewer ops than CUDA's (softmax, exp, log, sum and layer_norm stay
in float16 on the CPU, run in float32 on CUDA), so a CPU replay of a GPU job would fail
at other ops and other steps. While `emulated()` is entered, kernels for the AutocastCPU
dispatch key apply CUDA's lists instead (`setup.autocast_lists`):

    with emulated(), torch.autocast("cpu", torch.float16):
        torch.softmax(x.half(), -1).dtype     # torch.float32, as on CUDA

Ops that CPU autocast casts and CUDA's does not fall through (autocast leaves them alone,
as on CUDA); ops both already treat alike keep torch's own C++ kernel. The kernels live in
one `torch.library.Library`, created when the first user enters and destroyed when the
last leaves (the fast run holds it for all its steps: registering costs ~10 ms, a step's
enter and exit only a counter).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey, DispatchKeySet

from nandoctor.setup.autocast_lists import FP32_APPEND_DTYPE, POLICY, SAME_ON_CPU

_KEY = "AutocastCPU"
_EXCLUDE = DispatchKeySet(DispatchKey.AutocastCPU)
_FLOAT32 = torch.float32
_BANNED = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast "
    "(CUDA autocast refuses them; nandoctor replays CUDA's policy). Use "
    "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss."
)


class _Registration:
    """The one Library of emulation kernels, shared by nested and concurrent users."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.library: torch.library.Library | None = None

    def acquire(self) -> None:
        with self.lock:
            if self.users == 0:
                self.library = _register()
            self.users += 1

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self.library is not None:
                self.library._destroy()
                self.library = None


_REGISTRATION = _Registration()


@contextlib.contextmanager
def emulated() -> Iterator[None]:
    """CUDA's autocast lists for CPU autocast, until exit (the dtype is autocast's own)."""
    _REGISTRATION.acquire()
    try:
        yield
    finally:
        _REGISTRATION.release()


def is_emulating() -> bool:
    return _REGISTRATION.users > 0


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        # NB: torch warns when a kernel overrides CPU autocast's; overriding is the point.
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for name in _cpu_only_ops():
            library.impl(name, torch.library.fallthrough_kernel, _KEY)
        for name, policy in POLICY.items():
            if name not in SAME_ON_CPU and _exists(name):
                library.impl(name, _kernel(name, policy), _KEY)
    return library


def _cpu_only_ops() -> list[str]:
    """The ops CPU autocast casts and CUDA autocast does not."""
    names = torch._C._dispatch_get_registrations_for_dispatch_key(_KEY)
    return sorted(
        n.removeprefix("aten::")
        for n in names
        if n.startswith("aten::") and n.removeprefix("aten::") not in POLICY
    )


def _exists(name: str) -> bool:
    return torch._C._dispatch_has_kernel(f"aten::{name}")


def overload(name: str) -> torch._ops.OpOverload:
    """`pow.Tensor_Scalar` -> torch.ops.aten.pow.Tensor_Scalar."""
    base, _, variant = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), variant or "default")


def _kernel(name: str, policy: str) -> Callable[..., Any]:
    # NB: the C++ builtin under the OpOverload: one Python frame less on every call
    op = overload(name)._op
    if policy == "lower_precision_fp":
        return _cast_kernel(op, lambda args: torch.get_autocast_dtype("cpu"))
    if policy == "fp32":
        return _cast_kernel(op, lambda args: _FLOAT32)
    if policy == "promote":
        return _cast_kernel(op, _widest)
    if policy == "fp32_set_opt_dtype":
        return _set_dtype_kernel(op, overload(name)._schema)
    if policy == "fp32_append_dtype":
        return _append_dtype_kernel(overload(name), overload(FP32_APPEND_DTYPE[name])._op)
    return _banned_kernel


def _cast_kernel(op: Any, target: Callable[[tuple], torch.dtype]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            dtype = target(args)
            return op(*_cast(args, dtype), **_cast(kwargs, dtype))

    return kernel


def _set_dtype_kernel(op: Any, schema: Any) -> Callable[..., Any]:
    schema = schema.arguments
    index = next(i for i, a in enumerate(schema) if a.name == "dtype")
    keyword = schema[index].kwarg_only

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if not _eligible(args[0]):
                return op(*args, **kwargs)
            if keyword or index >= len(args):
                if kwargs.get("dtype") is None:
                    kwargs["dtype"] = _FLOAT32
            elif args[index] is None:
                args = (*args[:index], _FLOAT32, *args[index + 1 :])
            return op(*args, **kwargs)

    return kernel


def _append_dtype_kernel(op: Any, twin: Any) -> Callable[..., Any]:
    # NB: the dispatcher leaves out trailing defaults (norm's p=2); the twin needs them all
    defaults = [a.default_value for a in op._schema.arguments]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            first = args[0]
            dtype = _FLOAT32 if _eligible(first) else first.dtype
            return twin(*args, *defaults[len(args) :], **kwargs, dtype=dtype)

    return kernel


def _banned_kernel(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError(_BANNED)


def _eligible(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.is_cpu
    )


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if _eligible(value) and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _widest(args: tuple) -> torch.dtype:
    """CUDA's promote: float32 when any eligible input is float32, else the autocast dtype."""
    for value in _tensors(args):
        if _eligible(value) and value.dtype == torch.float32:
            return _FLOAT32
    return torch.get_autocast_dtype("cpu")


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


__all__ = ["emulated", "is_emulating", "overload"]
