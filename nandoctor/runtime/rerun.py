"""How a kept step is run again: the one thing the drivers of a replay differ in (the
localisation, and the recheck of a GradScaler skip at loss scale 1).

`diagnose` keeps each step's batch and re-runs it with its own `run_step` on the session
(`SessionSteps`). A `Guard` keeps the user's step function with copies of its arguments
(`KeptStep`) and calls it again; its phases are then announced by `StepHooks` in
explicit mode, as during the run (`KeptSteps`). Either way a probe (the tracer, the recheck's
gradient check) sees the same phases it would see in the other driver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from nandoctor.errors import user_code
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.probe import Probe
from nandoctor.runtime.step import run_step
from nandoctor.runtime.tensors import call_inputs, copy_into, host_copy
from nandoctor.setup.session import Session

StepFn = Callable[..., Any]


class StepRunner(Protocol):
    """Runs a kept step again; with a `probe`, the probe sees its phases. The user's code
    raising is a `UserCodeError`."""

    def run(self, step: int, kept: Any, probe: Probe | None = None) -> None: ...


@dataclass(frozen=True)
class SessionSteps:
    """nandoctor's own step on a `Session`; a kept step is its batch, and each run gets a
    copy of it (NB: on the CPU the step would hand the kept tensors themselves to a loss
    that may modify them in place, and the next replay of the step would see that)."""

    session: Session

    def run(self, step: int, kept: Any, probe: Probe | None = None) -> None:
        run_step(self.session, step, host_copy(kept), probe if probe is not None else Probe())


@dataclass(frozen=True)
class KeptStep:
    """A step's function and its arguments in host memory, with each tensor's device.
    Never mutated while it is kept, so copies share it (once the store drops it, a later
    step's `of` may refill its tensors); the snapshot store keeps it as it is
    (`copied=True`: walking it would copy its tensors twice), each replay gets fresh
    copies of its arguments."""

    fn: StepFn
    leaves: tuple[Any, ...]
    devices: tuple[torch.device | None, ...]
    spec: Any

    @classmethod
    def of(cls, fn: StepFn, args: tuple, kwargs: dict, reuse: Any = None) -> KeptStep:
        """`reuse`: a kept step no longer kept (`SnapshotStore.spare_batch`); each of its
        tensors laid out as this step's takes its values (no new host memory a step)."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        devices = tuple(t.device if isinstance(t, torch.Tensor) else None for t in leaves)
        if isinstance(reuse, KeptStep) and reuse.spec == spec and reuse.devices == devices:
            kept = tuple(_host_into(old, t) for old, t in zip(reuse.leaves, leaves, strict=True))
        else:
            kept = tuple(_host(t) for t in leaves)
        return cls(fn, kept, devices, spec)

    def arguments(self) -> tuple[tuple, dict]:
        """Fresh copies on the original devices (the step may modify its inputs)."""
        leaves = [
            t.to(d, copy=True) if isinstance(t, torch.Tensor) else t
            for t, d in zip(self.leaves, self.devices, strict=True)
        ]
        return pytree.tree_unflatten(leaves, self.spec)

    def __deepcopy__(self, memo: dict) -> KeptStep:
        return self


@dataclass(frozen=True)
class KeptSteps:
    """The user's own step function, kept by a `Guard`, called again on `objects`."""

    objects: HookedRun

    def run(self, step: int, kept: KeptStep, probe: Probe | None = None) -> None:
        args, kwargs = kept.arguments()
        where = f"{getattr(kept.fn, '__name__', 'the step')} (step {step})"
        if probe is None:
            with user_code(where):
                kept.fn(*args, **kwargs)
            return
        hooks = StepHooks(
            self.objects, probe, model=self.objects.model, explicit=True, start_step=step
        )
        with hooks:
            hooks.begin(named_batch(args, kwargs))
            with user_code(where):
                kept.fn(*args, **kwargs)
            hooks.end()


def named_batch(args: tuple, kwargs: dict) -> Any:
    """What the report calls the batch: the one argument, or all of them (by position and
    by name: `input:0`, `input:labels`)."""
    return args[0] if len(args) == 1 and not kwargs else call_inputs(args, kwargs)


def _host_into(old: Any, t: Any) -> Any:
    if isinstance(t, torch.Tensor) and copy_into(old, t):
        return old
    return _host(t)


def _host(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    if t.device.type == "cuda":  # NB: pinned and non-blocking: no host sync on the fast path
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to("cpu", copy=True)
