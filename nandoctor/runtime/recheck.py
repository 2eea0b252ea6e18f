"""Was a GradScaler skip an overflow, or a real failure the scaler hid?

The scaler skips a step whenever its scaled gradients hold inf or NaN. An overflow of
the scale is what fp16 training expects (a few at the start, one now and then when the
scale grows); a NaN from the math (sqrt at 0, 0/0 in backward) is skipped just the same,
and would go on being skipped. `ScaleOneRecheck` tells them apart by recomputing the
skipped step's gradients from the unscaled loss: rewind to the step (`SnapshotStore`),
run it again at loss scale 1 (same weights, same batch, same RNG, so dropout draws the
same masks) under a probe that only checks the gradients after backward, and put every
piece of state back: weights, gradients, optimizer, scaler, scheduler and RNG. Still
non-finite at scale 1: the scaler hid a real failure. Finite: an overflow.

It runs only when the sentinel's judge meets a skip (`runtime.judge.Judge`), so a
clean step costs nothing. A skip costs one state capture, the steps from the nearest
snapshot up to the skipped one (none while Adam & co. have no state yet, at the start
of a run, where the snapshots are every step), the step itself and two restores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nandoctor.errors import UserCodeError
from nandoctor.runtime import amp
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.rerun import StepRunner
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.state import TrainingObjects, device_of
from nandoctor.runtime.step_grads import StepGradients
from nandoctor.runtime.tensors import nonfinite


class GradientCheck(Probe):
    """Raises its flag when the gradients are non-finite at the end of BACKWARD (each
    end, with gradient accumulation); watches nothing else. One host read, in `bad`."""

    forward_phase = False

    def __init__(self, objects: TrainingObjects) -> None:
        self.objects = objects
        self._flag: torch.Tensor | None = None
        self._step_grads = StepGradients()  # NB: a GAN's other gradients, the last step's

    def step_started(self, ctx: StepContext) -> None:
        self._step_grads.begin(self.objects.params)

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        if phase is not Phase.BACKWARD:
            return
        grads = self._step_grads.of(self.objects.params)
        flag = nonfinite(grads, device_of(self.objects))
        self._flag = flag if self._flag is None else self._flag | flag

    @property
    def bad(self) -> bool | None:
        """None when no backward ended (the step never got there)."""
        return bool(self._flag) if self._flag is not None else None


@dataclass
class ScaleOneRecheck:
    """`runtime.judge.Recheck` for a driver that keeps snapshots and can run a kept
    step again (`steps`): `diagnose`'s session, a `Guard` through `guard.step`."""

    objects: TrainingObjects
    store: SnapshotStore
    steps: StepRunner

    def __call__(self, step: int) -> bool | None:
        """True: `step`'s gradients are non-finite at loss scale 1 too; False: finite
        (the skip was an overflow); None: it could not be rechecked (no snapshot reaches
        the step, or the user's code raised on the rerun)."""
        try:
            here = self.store.capture_now(-1)
        except LookupError:  # a hooked run that has not met its model or optimizer yet
            return None
        grads = Gradients.keep(self.objects)
        try:
            return self._at_scale_one(step)
        except (LookupError, UserCodeError):
            return None
        finally:
            here.restore(self.objects)
            grads.restore()

    def _at_scale_one(self, step: int) -> bool | None:
        kept = self.store.rewind_to(step)
        for s, batch in kept[:-1]:  # from the snapshot up to the skipped step, as they ran
            self.store.drawn(s)
            self.steps.run(s, batch)
        scaler = self.objects.scaler
        if scaler is not None:
            amp.set_scale(scaler, 1.0, device_of(self.objects))
        check = GradientCheck(self.objects)
        self.store.drawn(step)
        self.steps.run(step, kept[-1][1], check)
        return check.bad


@dataclass
class Gradients:
    """The parameters' gradients, kept by identity and by value: the rerun replaces them
    (zero_grad) or writes into them in place, and the user's loop must find them as it
    left them; some code holds on to the tensors themselves (DDP's gradient buckets).
    The values wait in host memory: a second copy of every gradient may not fit on the
    device."""

    kept: list[tuple[torch.nn.Parameter, torch.Tensor | None, torch.Tensor | None]]

    @classmethod
    def keep(cls, objects: TrainingObjects) -> Gradients:
        kept = []
        for p in objects.params:
            g = p.grad
            kept.append((p, g, g.detach().to("cpu", copy=True) if g is not None else None))
        return cls(kept)

    def restore(self) -> None:
        with torch.no_grad():
            for p, grad, value in self.kept:
                if grad is not None and value is not None:
                    grad.copy_(value)
                p.grad = grad


__all__ = ["GradientCheck", "Gradients", "ScaleOneRecheck"]
