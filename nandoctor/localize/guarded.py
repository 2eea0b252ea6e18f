"""Rewind a user's own loop to its bad step and replay that step under the tracer.

`Guard.step(fn, batch)` gives what a replay needs: the step as a callable and its
arguments. Before each step the `SnapshotStore` of `diagnose` keeps the training state
(by its policy) and the step (its arguments copied to host memory, `KeptStep`); at the bad step
the state is restored, the steps in between are re-run plainly by calling `fn` again,
and the bad step runs under the `Tracer`, its phases announced by `StepHooks` in explicit
mode. Afterwards the state is put back as the user's loop left it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from nandoctor.errors import NandoctorError
from nandoctor.localize.replay import Localization, update_ratio
from nandoctor.localize.tracer import Tracer
from nandoctor.runtime import amp
from nandoctor.runtime.hooked import Run
from nandoctor.runtime.hooks import StepHooks
from nandoctor.runtime.snapshot import SnapshotStore

StepFn = Callable[..., Any]


@dataclass(frozen=True)
class KeptStep:
    """A step's function and its arguments in host memory, with each tensor's device.
    Never mutated, so copies share it (the store deep-copies what it keeps)."""

    fn: StepFn
    leaves: tuple[Any, ...]
    devices: tuple[torch.device | None, ...]
    spec: Any

    @classmethod
    def of(cls, fn: StepFn, args: tuple, kwargs: dict) -> KeptStep:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        devices = tuple(t.device if isinstance(t, torch.Tensor) else None for t in leaves)
        return cls(fn, tuple(_host(t) for t in leaves), devices, spec)

    def arguments(self) -> tuple[tuple, dict]:
        """Fresh copies on the original devices (the step may modify its inputs)."""
        leaves = [
            t.to(d, copy=True) if isinstance(t, torch.Tensor) else t
            for t, d in zip(self.leaves, self.devices, strict=True)
        ]
        return pytree.tree_unflatten(leaves, self.spec)

    def __call__(self) -> Any:
        args, kwargs = self.arguments()
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> KeptStep:
        return self


def named_batch(args: tuple, kwargs: dict) -> Any:
    """What the report calls the batch: the one argument, or all of them."""
    return args[0] if len(args) == 1 and not kwargs else (args, kwargs)


def _host(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    if t.device.type == "cuda":  # NB: pinned and non-blocking: no host sync on the fast path
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to("cpu", copy=True)


@dataclass
class TrainState:
    """The objects a snapshot captures and restores (the attributes `Session` has)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    scheduler: Any | None
    device: torch.device
    start_step: int = 0

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def localize_step(
    state: TrainState, store: SnapshotStore, step: int, loss_scale: float | None = None
) -> Localization:
    """Replay `step` of the user's loop under the tracer; leave no trace."""
    started = time.perf_counter()
    here = store.capture_now(-1)
    try:
        return _replay(state, store, step, started, loss_scale)
    except LookupError as e:
        return Localization(step, None, note=f"could not rewind: {e}")
    except NandoctorError:
        raise
    except Exception as e:  # the user's step raised when called again
        note = f"the replay of step {step} failed: {type(e).__name__}: {e}"
        return Localization(step, None, note=note)
    finally:
        here.restore(state)  # type: ignore[arg-type]


def _replay(
    state: TrainState, store: SnapshotStore, step: int, started: float, loss_scale: float | None
) -> Localization:
    batches = store.rewind_for_replay(step)
    update = None
    for s, kept in batches[:-1]:  # re-run the steps in between, measuring their updates
        before = [p.detach().clone() for p in state.params]
        kept()
        ratio = update_ratio(state, s, before)  # type: ignore[arg-type]
        update = ratio if ratio.ratio > 0 else update  # a skipped step moves nothing
    note = None
    if loss_scale is not None and state.scaler is not None:
        amp.set_scale(state.scaler, loss_scale, state.device)
        note = f"replayed at loss scale {loss_scale:g}, where the streak of skips ended"
    tracer = _traced(state, step, batches[-1][1])
    finding = tracer.finding
    if finding is not None:
        finding = replace(finding, evidence=replace(finding.evidence, update=update))
    seconds = time.perf_counter() - started
    modules = tracer.modules.stats()
    return Localization(
        step, finding, modules, batches[0][0], seconds, note, transients=tracer.transients
    )


def _traced(state: TrainState, step: int, kept: KeptStep) -> Tracer:
    run = Run(model=state.model, device=state.device, scaler=state.scaler)
    run.note_optimizer(state.optimizer)
    tracer = Tracer(state.model, state.optimizer)
    args, kwargs = kept.arguments()
    hooks = StepHooks(run, tracer, model=state.model, explicit=True, start_step=step)
    with tracer, hooks:
        hooks.begin(named_batch(args, kwargs))
        kept.fn(*args, **kwargs)
        hooks.end()
    return tracer
