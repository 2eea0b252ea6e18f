"""Every global patch nandoctor makes: the few places PyTorch offers no global hook,
wrapped while someone listens and given back after.

PyTorch has global hooks for module forwards and optimizer steps, but none for "backward
was called on this loss", "this loss was scaled by a GradScaler", "this GradScaler step
began and ended" (a skipped step never calls `optimizer.step()`), "the gradients were
unscaled" or "the gradients were clipped to N" (`StepHooks`, following a user's loop:
`register`), nor for "a softmax ran, on these logits" (the forecast's precursors, whose
softmaxes can sit outside any module, in the user's loss: `listen_softmaxes`; a
`TorchFunctionMode` would cost every torch call of every step), nor for "a custom autograd
Function was applied", which function modes never see (the tracer's node map:
`observe_applies`; the guard of an origin op that is such a Function: `guard_applies`),
nor for "torch.compile is building a module" (`runtime.calls`, which hands it the
classes' own `__call__`: `listen_compiles`). Each set is wrapped exactly here, while it
has a listener:

    steps:      torch.autograd.backward     (Tensor.backward calls it through the module)
                torch.amp.GradScaler.scale / .step / .unscale_
                                            (torch.cuda.amp.GradScaler inherits them)
                torch.nn.utils.clip_grad_norm_
                                            (both names users import it under, and the
                                            scaling it calls: a name imported before the
                                            patch still reaches that)
                torch.nn.utils.clip_grads_with_norm_
                                            (that scaling's public name, after
                                            `get_total_norm`: accelerate clips so)
    softmaxes:  torch.softmax, torch.Tensor.softmax   (F.softmax and nn.Softmax call it)
                torch.log_softmax, torch.Tensor.log_softmax   (F.log_softmax calls it)
                torch.log, torch.Tensor.log    (to see a softmax's output logged)
                torch.nn.functional.scaled_dot_product_attention
    applies:    torch.autograd.Function.apply  (every custom Function inherits it)
    compiles:   torch.compile

A set is installed when its first listener registers and restored when its last one
leaves (`_Patches`), so nested guards (a `Guard` inside a watched script) compose in any
order; each attribute comes back as the very object it was (`torch.softmax is` the
original again). While a set is on, code that compares those callables by identity sees
the wrappers (`functools.wraps` keeps their names and docs), and so does a user's
`TorchFunctionMode`, which torch hands `torch.Tensor.softmax` as it finds it there. A
wrapper calls the original and tells its listeners, host-side only; with no listener left
it behaves exactly like the original.

Not here, because they are not global: `runtime.calls` wraps the followed modules'
classes' `__call__` (a patch of one module's class, for as long as that module is
followed), and `watch.bootstrap` one loader's `exec_module`, once. Nor are Python's own:
`os._exit` is wrapped by `cli.app` (an exception in the command's own process, which
`--help` keeps torch-free) and by `watch.child` (the watched script's call writes what was
seen first).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from nandoctor.runtime import softmax_watch
from nandoctor.setup.scaler import explain_float16_unscale


class StepListener(Protocol):
    """What a registered listener is told; each call is cheap and host-side only."""

    def backward_started(self, tensors: Any) -> None: ...

    def backward_ended(self, ok: bool) -> None: ...

    def scaled(
        self, scaler: torch.amp.GradScaler, loss: torch.Tensor, out: torch.Tensor
    ) -> None: ...

    def optimizer_entered(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None: ...

    def optimizer_exited(self, optimizer: torch.optim.Optimizer, ok: bool) -> None: ...

    def clipped(self, max_norm: float | None) -> None: ...

    def unscaled(self) -> None: ...


class ApplyGuard(Protocol):
    """Runs a custom autograd Function's `apply` its own way (in float32, from one line)."""

    def guard_apply(self, apply: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
        """`apply(cls, *args, **kwargs)` is the call as it would run without this guard."""


class ApplyObserver(Protocol):
    def applied(self, cls: type, out: Any) -> None:
        """`cls.apply(...)` returned `out` (to its caller: after every guard)."""


class CompileListener(Protocol):
    def compiling(self) -> contextlib.AbstractContextManager[None]:
        """Entered around each call of `torch.compile`."""


_ABSENT = object()  # an attribute the owner had not itself (a class's, inherited)


class _Patches:
    """A set of global patches, on while at least one listener is registered: the first
    to register installs them (`install`), the last to leave restores each attribute as it
    was: the very object the owner held (`torch.softmax is` the original again), or none
    where the owner only inherited it (a `torch.Tensor` method of its C base shows through
    again). An attribute replaced since by someone else (a user's own patch over ours) is
    left to its owner."""

    def __init__(self, name: str, install: Callable[[_Patches], None]) -> None:
        self.name, self.install = name, install
        self.listeners: list[Any] = []
        self._saved: list[tuple[Any, str, Any, Any]] = []  # owner, name, its own, ours

    def register(self, listener: Any) -> None:
        if not self.listeners:
            try:
                self.install(self)
            except BaseException:
                self._restore()  # NB: never half installed
                raise
        self.listeners.append(listener)

    def unregister(self, listener: Any) -> None:
        if listener in self.listeners:
            self.listeners.remove(listener)
        if not self.listeners:
            self._restore()

    def patch(self, owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        """Replace `owner.name` by `wrap(what it is now)`; refused for an attribute another
        set (or this one) has patched already: one wrapper a callable."""
        key = (id(owner), name)
        if key in _patched:
            raise RuntimeError(f"nandoctor: {name} is patched twice ({_patched[key]}, {self.name})")
        ours = wrap(getattr(owner, name))
        self._saved.append((owner, name, vars(owner).get(name, _ABSENT), ours))
        _patched[key] = self.name
        setattr(owner, name, ours)

    def _restore(self) -> None:
        while self._saved:  # NB: in reverse order of install
            owner, name, own, ours = self._saved.pop()
            del _patched[(id(owner), name)]
            if vars(owner).get(name, _ABSENT) is not ours:
                continue  # NB: replaced since: left to whoever replaced it
            if own is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


_patched: dict[tuple[int, str], str] = {}  # (id(owner), name) -> the set that patched it


def register(listener: StepListener) -> None:
    """`listener` is told of backward, the GradScaler's steps and clipping (`StepListener`)."""
    _STEPS.register(listener)


def unregister(listener: StepListener) -> None:
    _STEPS.unregister(listener)


def listen_softmaxes(listener: softmax_watch.SoftmaxListener) -> None:
    """`listener` is told of each softmax, log_softmax, scaled-dot-product attention and
    log call (`softmax_watch.SoftmaxListener`)."""
    _SOFTMAXES.register(listener)


def stop_listening_softmaxes(listener: softmax_watch.SoftmaxListener) -> None:
    _SOFTMAXES.unregister(listener)


def guard_applies(guard: ApplyGuard) -> None:
    """`guard` runs each custom autograd Function's `apply` (`ApplyGuard`). Guards nest in
    the order they registered, as nested `with`s would: the first is given torch's own
    `apply`, each later one the guard before it."""
    _APPLIES.register((_GUARD, guard))


def stop_guarding_applies(guard: ApplyGuard) -> None:
    _APPLIES.unregister((_GUARD, guard))


def observe_applies(observer: ApplyObserver) -> None:
    """`observer` is told of each custom autograd Function's `apply` and what it returned
    (`ApplyObserver`), after the call: never on the stack while the call runs (a guard
    reads the stack for the line it guards)."""
    _APPLIES.register((_OBSERVER, observer))


def stop_observing_applies(observer: ApplyObserver) -> None:
    _APPLIES.unregister((_OBSERVER, observer))


def listen_compiles(listener: CompileListener) -> None:
    """`listener.compiling()` is entered around each call of `torch.compile`."""
    _COMPILES.register(listener)


def stop_listening_compiles(listener: CompileListener) -> None:
    _COMPILES.unregister(listener)


def _install_steps(patches: _Patches) -> None:
    import torch.nn.utils.clip_grad as clip_grad  # NB: the same function as torch.nn.utils'

    patches.patch(torch.autograd, "backward", _wrap_backward)
    patches.patch(torch.amp.GradScaler, "scale", _wrap_scale)
    patches.patch(torch.amp.GradScaler, "step", _wrap_scaler_step)
    patches.patch(torch.amp.GradScaler, "unscale_", _wrap_unscale)
    clip = _wrap_clip(torch.nn.utils.clip_grad_norm_)
    for owner in (torch.nn.utils, clip_grad):  # NB: one wrapper under both names
        patches.patch(owner, "clip_grad_norm_", lambda _: clip)
    if hasattr(clip_grad, "_clip_grads_with_norm_"):  # NB: torch >= 2.6
        # `from torch.nn.utils import clip_grad_norm_` binds the function before any patch,
        # but it scales the gradients through this module-level name, looked up per call
        patches.patch(clip_grad, "_clip_grads_with_norm_", _wrap_clip)
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
        # the same function's public name: `get_total_norm` then `clip_grads_with_norm_`,
        # the split form accelerate's `clip_grad_norm_` (and the Trainer's clip) imports
        patches.patch(torch.nn.utils, "clip_grads_with_norm_", _wrap_clip)


def _install_softmaxes(patches: _Patches) -> None:
    """NB: `F.softmax` and `F.log_softmax` are not wrapped themselves: they call
    `input.softmax(dim)`, whose wrapper sees the call, so no function of
    `torch.nn.functional` but scaled-dot-product attention changes identity."""
    softmax = functools.partial(_wrap_softmax, op=softmax_watch.SOFTMAX)
    log_softmax = functools.partial(_wrap_softmax, op=softmax_watch.LOG_SOFTMAX)
    for owner in (torch, torch.Tensor):
        patches.patch(owner, "softmax", softmax)
        patches.patch(owner, "log_softmax", log_softmax)
        patches.patch(owner, "log", _wrap_log)
    patches.patch(F, "scaled_dot_product_attention", _wrap_attention)


def _install_applies(patches: _Patches) -> None:
    patches.patch(torch.autograd.Function, "apply", _wrap_apply)


def _install_compiles(patches: _Patches) -> None:
    patches.patch(torch, "compile", _wrap_compile)


_STEPS = _Patches("steps", _install_steps)
_SOFTMAXES = _Patches("softmaxes", _install_softmaxes)
_APPLIES = _Patches("applies", _install_applies)  # listeners: (_GUARD or _OBSERVER, one)
_COMPILES = _Patches("compiles", _install_compiles)
_GUARD, _OBSERVER = "guard", "observer"


def _each(method: str, *args: Any) -> None:
    for listener in list(_STEPS.listeners):
        getattr(listener, method)(*args)


_graph_keepers: list[Callable[[], bool]] = []


def keep_graph_when(keeper: Callable[[], bool]) -> None:
    """While `keeper()` says so, a backward keeps its graph (`retain_graph=True`): a
    rerun that recomputes a step's gradients at loss scale 1 from its unscaled loss
    (`watch/recheck.py`). Removed with `unkeep`; installs nothing by itself."""
    _graph_keepers.append(keeper)


def unkeep(keeper: Callable[[], bool]) -> None:
    if keeper in _graph_keepers:
        _graph_keepers.remove(keeper)


_asked_to_retain = False  # the last backward's own retain_graph (or create_graph)


def asked_to_retain() -> bool:
    """Whether the last backward's caller kept its graph itself (a loop that backwards
    through it again): whoever uses the graph after must then keep it too."""
    return _asked_to_retain


def _retaining(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`torch.autograd.backward`'s arguments with retain_graph=True (`Tensor.backward`
    passes it as the third positional one, create_graph as the fourth)."""
    global _asked_to_retain
    given = [*args[1:3], kwargs.get("retain_graph"), kwargs.get("create_graph")]
    _asked_to_retain = any(bool(v) for v in given if not isinstance(v, torch.Tensor))
    if len(args) >= 2:
        return (args[0], True, *args[2:]), kwargs
    return args, {**kwargs, "retain_graph": True}


def _wrap_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        _each("backward_started", tensors)
        if _graph_keepers and any(keep() for keep in _graph_keepers):
            args, kwargs = _retaining(args, kwargs)
        try:
            out = original(tensors, *args, **kwargs)
        except BaseException:
            _each("backward_ended", False)
            raise
        _each("backward_ended", True)
        return out

    return backward


def _wrap_scale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scale(self: torch.amp.GradScaler, outputs: Any) -> Any:
        out = original(self, outputs)
        if isinstance(outputs, torch.Tensor) and out is not outputs:  # enabled, one loss
            _each("scaled", self, outputs, out)
        return out

    return scale


def _wrap_scaler_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: torch.amp.GradScaler, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        # NB: a skipped step never reaches optimizer.step(), so its hooks never fire:
        # the scaler's step is where a step of a GradScaler run begins and ends.
        _each("optimizer_entered", optimizer, self)
        try:
            out = original(self, optimizer, *args, **kwargs)
        except BaseException:
            _each("optimizer_exited", optimizer, False)
            raise
        _each("optimizer_exited", optimizer, True)
        return out

    return step


def _wrap_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_(self: torch.amp.GradScaler, optimizer: Any) -> Any:
        try:
            out = original(self, optimizer)
        except ValueError as e:  # NB: float16 weights: the user's error, with the way out
            explain_float16_unscale(e)
            raise
        _each("unscaled")
        return out

    return unscale_


def _wrap_clip(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        # NB: float() of a tensor max_norm would be a host sync: only plain numbers are kept
        number = float(max_norm) if isinstance(max_norm, (int, float)) else None
        if number != math.inf:  # NB: an infinite max_norm measures the norm, clips nothing
            _each("clipped", number)
        return original(parameters, max_norm, *args, **kwargs)

    return clip_grad_norm_


# -- softmaxes (the forecast's: `softmax_watch` says what each call tells its listeners) --
_inside = threading.local()  # NB: a wrapper reached again from within (a user's mode)


def _outermost(original: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> tuple:
    """The original's result, and whether this call is the outermost of the softmaxes'
    wrappers: with a `TorchFunctionMode` of the user's active, torch hands the mode the
    method as it finds it on `torch.Tensor` (the wrapper), and a mode that calls it
    reaches the wrapper again; the listeners are told once."""
    depth = getattr(_inside, "depth", 0)
    _inside.depth = depth + 1
    try:
        return original(*args, **kwargs), depth == 0
    finally:
        _inside.depth = depth


def _wrap_softmax(original: Callable[..., Any], op: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def softmax(*args: Any, **kwargs: Any) -> Any:
        out, outermost = _outermost(original, args, kwargs)
        if outermost and _SOFTMAXES.listeners:
            softmax_watch.tell_softmax(_SOFTMAXES.listeners, op, args, kwargs, out)
        return out

    return softmax


def _wrap_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Any:
        out, outermost = _outermost(original, args, kwargs)
        if outermost and _SOFTMAXES.listeners:
            softmax_watch.tell_attention(_SOFTMAXES.listeners, args, kwargs)
        return out

    return scaled_dot_product_attention


def _wrap_log(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def log(*args: Any, **kwargs: Any) -> Any:
        if _SOFTMAXES.listeners and not getattr(_inside, "depth", 0):
            softmax_watch.tell_log(_SOFTMAXES.listeners, args, kwargs)
        return _outermost(original, args, kwargs)[0]

    return log


# -- custom autograd Functions' apply, and torch.compile ----------------------------------
def _wrap_apply(original: Any) -> classmethod:
    """NB: `original` is `Function.apply` as `getattr` gives it, bound to `Function`; the
    function under it takes the class the call is made on, and so does the wrapper."""
    run = original.__func__
    return classmethod(functools.wraps(run)(functools.partial(_applied, run)))


def _applied(run: Callable[..., Any], cls: type, *args: Any, **kwargs: Any) -> Any:
    """`cls.apply(*args, **kwargs)`: `run` through the guards, then the observers told."""
    listeners = list(_APPLIES.listeners)
    call = run
    for kind, guard in listeners:
        if kind == _GUARD:
            call = functools.partial(guard.guard_apply, call)
    out = call(cls, *args, **kwargs)
    for kind, observer in listeners:
        if kind == _OBSERVER:
            observer.applied(cls, out)
    return out


def passes_through(frame: FrameType) -> bool:
    """`frame` is a wrapper's that only hands a call on to torch's own: the apply wrapper,
    or a softmax, log or attention wrapper of the forecast's. A walk up the stack to the
    user's line that made the call passes over it, as it passes over the listeners' own
    frames (an op that torch's softmax issues under a mode is the user's softmax)."""
    return frame.f_code in _PASSING_THROUGH


def _wrap_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for listener in list(_COMPILES.listeners):
                stack.enter_context(listener.compiling())
            return original(*args, **kwargs)

    return compile


def _inner_codes(*makers: Callable[..., Any]) -> frozenset[CodeType]:
    """The code of the functions each maker defines (one per wrapped callable, one code)."""
    return frozenset(c for m in makers for c in m.__code__.co_consts if isinstance(c, CodeType))


_PASSING_THROUGH = frozenset({_applied.__code__, _outermost.__code__}) | _inner_codes(
    _wrap_softmax, _wrap_attention, _wrap_log
)
