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

from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.probe import Probe
from nandoctor.runtime.step import run_step
from nandoctor.runtime.tensors import HostBuffers, call_inputs, host_copy, map_tensors
from nandoctor.setup.session import Session
from nandoctor.setup.user_code import user_code

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
    """A step's function and its arguments (`call`: args and kwargs) with their tensors in
    host memory, and each tensor's device. Never mutated while it is kept, so copies share
    it (once the store drops it, a later step's `of` may copy into its tensors); the
    snapshot store keeps it as it is (`copied=True`: walking it would copy its tensors
    twice), each replay gets fresh copies of its arguments.

    The arguments are walked as a batch is (`tensors.map_tensors`: tuples, lists,
    mappings such as transformers' `BatchEncoding`, dataclasses), each container rebuilt;
    anything else (a model, a config) is kept as it is, as is a tensor that requires grad
    (a parameter: the model's own state, which the snapshot restores)."""

    fn: StepFn
    call: tuple[tuple, dict]
    devices: tuple[torch.device | None, ...]  # in `map_tensors`' order; None: kept as it is

    @classmethod
    def of(cls, fn: StepFn, args: tuple, kwargs: dict, reuse: Any = None) -> KeptStep:
        """`reuse`: a kept step no longer kept (`SnapshotStore.spare_batch`); its tensors
        lend their buffers to this step's laid out alike (no new host memory a step)."""
        buffers = HostBuffers(reuse.call if isinstance(reuse, KeptStep) else None)
        devices: list[torch.device | None] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                devices.append(None)
                return t
            devices.append(t.device)
            return buffers.copy(t, _host)

        call = map_tensors((args, kwargs), keep)
        return cls(fn, call, tuple(devices))

    def arguments(self) -> tuple[tuple, dict]:
        """Fresh copies on the original devices (the step may modify its inputs)."""
        devices = iter(self.devices)

        def fresh(t: torch.Tensor) -> torch.Tensor:
            device = next(devices)
            return t if device is None else t.to(device, copy=True)

        return map_tensors(self.call, fresh)

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
            self.objects,
            probe,
            model=self.objects.model,
            explicit=True,
            start_step=step,
            warn=False,
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


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type == "cuda":  # NB: pinned and non-blocking: no host sync on the fast path
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to("cpu", copy=True)
