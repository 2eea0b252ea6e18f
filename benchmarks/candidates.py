"""The loops being compared, each stepping its own copy of the same run.

- plain: the loop a user writes (autocast, GradScaler, unscale_, step, update);
- loop: nandoctor's step with no probe (the price of the phases alone);
- sentinel: nandoctor's step with the sentinel, read every step (what `diagnose` runs);
- sentinel+snapshots: the same, plus the snapshot store (what `diagnose` really runs);
- anomaly: the plain loop under `torch.autograd.set_detect_anomaly(True)`;
- transformers: the plain loop with transformers' `DebugUnderflowOverflow` (optional);
- watch: the plain loop with `nandoctor watch`'s global hooks attached (when available).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nandoctor.runtime.probe import Probe
from nandoctor.runtime.sentinel import Sentinel
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.step import run_step
from nandoctor.runtime.tensors import to_device
from nandoctor.setup.session import Session


class Candidate:
    def __init__(self, session: Session) -> None:
        self.session = session

    def step(self, step: int, batch: Any) -> None:
        plain_step(self.session, batch)

    def close(self) -> None:
        pass


def plain_step(s: Session, batch: Any) -> None:
    """The user's loop, written out: what every other candidate is measured against."""
    batch = to_device(batch, s.device)
    s.optimizer.zero_grad(set_to_none=True)
    with s.autocast():
        loss = s.loss_fn(s.model, batch)
    if s.scaler is not None:
        s.scaler.scale(loss).backward()
        s.scaler.unscale_(s.optimizer)
        s.scaler.step(s.optimizer)
        s.scaler.update()
    else:
        loss.backward()
        s.optimizer.step()


class Loop(Candidate):
    def step(self, step: int, batch: Any) -> None:
        run_step(self.session, step, batch, Probe())


class WithSentinel(Candidate):
    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.sentinel = Sentinel(session)

    def step(self, step: int, batch: Any) -> None:
        run_step(self.session, step, batch, self.sentinel)
        for _ in self.sentinel.collect():
            pass

    def close(self) -> None:
        for _ in self.sentinel.collect(final=True):
            pass


class WithSnapshots(WithSentinel):
    def __init__(self, session: Session) -> None:
        super().__init__(session)
        self.store = SnapshotStore(session)

    def step(self, step: int, batch: Any) -> None:
        self.store.before_step(step, batch)
        super().step(step, batch)


class Anomaly(Candidate):
    def step(self, step: int, batch: Any) -> None:
        # NB: per step, not for the candidate's lifetime: the mode is global (thread-local)
        # and must not slow the candidates interleaved with this one
        with torch.autograd.set_detect_anomaly(True):
            plain_step(self.session, batch)


class TransformersDebug(Candidate):
    """transformers' DebugUnderflowOverflow: forward hooks on every module, every step."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        from transformers.debug_utils import DebugUnderflowOverflow

        self._debug = DebugUnderflowOverflow(session.model, max_frames_to_save=21)


class Watch(Candidate):
    """`nandoctor watch`'s global hooks and monitor on the plain loop (what a watched script
    pays). NB: attached around each step, since global hooks would slow every candidate."""

    def __init__(self, session: Session) -> None:
        super().__init__(session)
        from nandoctor.runtime.hooked import Run
        from nandoctor.runtime.hooks import StepHooks
        from nandoctor.runtime.monitor import Monitor

        run = Run()
        self.monitor = Monitor(run)
        self.hooks = StepHooks(run, self.monitor, model=session.model)

    def step(self, step: int, batch: Any) -> None:
        with self.hooks:
            plain_step(self.session, batch)
        for _ in self.monitor.collect():
            pass


def available() -> dict[str, Callable[[Session], Candidate]]:
    out: dict[str, Callable[[Session], Candidate]] = {
        "plain": Candidate,
        "loop": Loop,
        "sentinel": WithSentinel,
        "sentinel+snapshots": WithSnapshots,
        "anomaly": Anomaly,
        "watch": Watch,
    }
    try:
        import transformers.debug_utils  # noqa: F401
    except ImportError:
        pass
    else:
        out["transformers"] = TransformersDebug
    return out
