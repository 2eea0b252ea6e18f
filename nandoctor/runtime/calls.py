"""A module's calls, seen at its class: nothing put on the module, no global module hook.

`StepHooks` must see each call of the model with its keyword arguments (`model(**batch)`)
and each call of a `torch.compile`d module. A forward hook would see them, but it lives
in the module: `torch.save(model)` pickles it with everything it holds ("TypeError:
cannot pickle 'WeakIdRef' object"), and `copy.deepcopy(model)` (an EMA) copies it into
the copy. A global module hook lives in torch instead, but `torch.compile(model)` warns
about any at each call ("Using `torch.compile(module)` when there are global hooks on
modules ...") and traces it into its graph. So the calls are seen at the class: while an
instance is followed (`follow`), or every `OptimizedModule` (`follow_compiled`), the
class's `__call__` is wrapped, and the wrapper tells the followers before and after the
call. The module, its state, its hooks and its `__dict__` stay as the user made them;
the class gets its own `__call__` back when its last follower leaves.

    calls.follow(model, hooks)      hooks.call_started(model, args, kwargs)
    model(x, mask=m)                ... forward ...
                                    hooks.call_ended(model, args, kwargs, output)
    calls.unfollow(hooks)           type(model).__call__ is the class's own again

NB: the wrapper steps aside while `torch.compile` traces (`is_compiling`): a compiled
region calls the original, as if nothing were there. `torch.compile` itself builds its
`OptimizedModule` with the classes' own `__call__` (it keeps the one it finds), so that
a compiled module never holds nandoctor's wrapper: while anything is followed, each call
of `torch.compile` is announced here (`compiling`, through `runtime.wrappers`, where the
one global patch of `torch.compile` is).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from nandoctor.runtime import wrappers


class Follower(Protocol):
    def call_started(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None: ...

    def call_ended(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> None:
        """`output` is None when the call raised."""


_modules: dict[int, tuple[nn.Module, list[Follower]]] = {}  # id -> the module, its followers
_compiled: list[Follower] = []  # the followers of every OptimizedModule's calls
_wrapped: dict[type, tuple[Callable[..., Any] | None, Callable[..., Any]]] = {}  # own, ours
# NB: each class's wrapper, made once: a compiled region that calls the class guards on
# its `__call__`, and a new wrapper at each attach (`guard.step`'s) would recompile it
_made: dict[type, tuple[Callable[..., Any] | None, Callable[..., Any]]] = {}
_listening = False  # told of each torch.compile (`wrappers.listen_compiles`)
_optimized: type | None = None  # torch.compile's module class, once torch has imported it


def follow(module: nn.Module, follower: Follower) -> None:
    """`follower` is told of each call of `module` (of its exact class), until `unfollow`."""
    _, followers = _modules.setdefault(id(module), (module, []))
    if follower not in followers:
        followers.append(follower)
    _wrap(type(module))
    _wrap_compile()


def follow_compiled(follower: Follower) -> None:
    """`follower` is told of each call of any `torch.compile`d module, until `unfollow`
    (from the first `torch.compile` on, when torch has not compiled anything yet)."""
    if follower not in _compiled:
        _compiled.append(follower)
    _wrap_compile()
    optimized = _optimized_module()
    if optimized is not None:
        _wrap(optimized)


def followed(module: nn.Module, follower: Follower) -> bool:
    """Whether `follower` is told of `module`'s calls (`follow`, or as a compiled module)."""
    entry = _modules.get(id(module))
    if entry is not None and entry[0] is module and follower in entry[1]:
        return True
    return follower in _compiled and compiled(module)


def compiled(module: nn.Module) -> bool:
    """`module` is `torch.compile(a module)`."""
    optimized = _optimized_module()
    return optimized is not None and type(module) is optimized


def unfollow(follower: Follower) -> None:
    """`follower` is told of no call any more; classes with no follower left are restored."""
    for key, (_, followers) in list(_modules.items()):
        if follower in followers:
            followers.remove(follower)
        if not followers:
            del _modules[key]
    if follower in _compiled:
        _compiled.remove(follower)
    kept: set[type | None] = {type(module) for module, _ in _modules.values()}
    if _compiled:
        kept.add(_optimized_module())
    for cls in [c for c in _wrapped if c not in kept]:
        _unwrap(cls)
    if not _modules and not _compiled:
        _unwrap_compile()


def _followers(cls: type, module: nn.Module) -> list[Follower]:
    if type(module) is not cls:  # NB: a subclass that inherits the wrapper
        return []
    entry = _modules.get(id(module))
    own = entry[1] if entry is not None and entry[0] is module else []
    if _compiled and cls is _optimized_module():
        return [*_compiled, *(f for f in own if f not in _compiled)]
    return own


def _wrap(cls: type) -> None:
    if cls in _wrapped:
        return
    made = _made.get(cls)
    if made is None or made[0] is not cls.__dict__.get("__call__"):
        made = _wrapper(cls)
    _wrapped[cls] = _made[cls] = made
    cls.__call__ = made[1]  # type: ignore[method-assign]


def _wrapper(cls: type) -> tuple[Callable[..., Any] | None, Callable[..., Any]]:
    """The class's own `__call__` (None: inherited, nn.Module's mostly) and its wrapper."""
    own = cls.__dict__.get("__call__")

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if own is not None:
            return own(self, *args, **kwargs)
        return super(cls, self).__call__(*args, **kwargs)  # type: ignore[arg-type]

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        followers = [] if torch.compiler.is_compiling() else _followers(cls, self)
        if not followers:
            return call(self, *args, **kwargs)
        for follower in followers:
            follower.call_started(self, args, kwargs)
        try:
            out = call(self, *args, **kwargs)
        except BaseException:
            for follower in reversed(followers):
                follower.call_ended(self, args, kwargs, None)
            raise
        for follower in reversed(followers):
            follower.call_ended(self, args, kwargs, out)
        return out

    return own, __call__


def _unwrap(cls: type) -> None:
    own, ours = _wrapped.pop(cls)
    if cls.__dict__.get("__call__") is not ours:  # NB: replaced since: left to its owner
        return
    if own is None:
        delattr(cls, "__call__")
    else:
        cls.__call__ = own  # type: ignore[method-assign]


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """The classes' own `__call__` for a while: `torch.compile(model)` binds the one it
    finds into its `OptimizedModule`."""
    saved = dict(_wrapped)
    for cls in saved:
        _unwrap(cls)
    try:
        yield
    finally:
        for cls in saved:
            _wrap(cls)


def _optimized_module() -> type | None:
    """torch.compile's module class, once torch has imported it (NB: `import torch._dynamo`
    costs a second: never done here)."""
    global _optimized
    if _optimized is None:
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        _optimized = getattr(eval_frame, "OptimizedModule", None)
    return _optimized


class _Compiles:
    """`torch.compile` builds its module with the classes' own `__call__`; the first
    `OptimizedModule` it returns is followed from its first call on."""

    @contextlib.contextmanager
    def compiling(self) -> Iterator[None]:
        with _unwrapped():
            yield
        optimized = _optimized_module()
        if _compiled and optimized is not None:
            _wrap(optimized)


_COMPILES = _Compiles()


def _wrap_compile() -> None:
    global _listening
    if not _listening:
        wrappers.listen_compiles(_COMPILES)
        _listening = True


def _unwrap_compile() -> None:
    global _listening
    if _listening:
        wrappers.stop_listening_compiles(_COMPILES)
        _listening = False
