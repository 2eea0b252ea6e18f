"""The interface between the one training step and everything that watches it.

The loop (`nandoctor.runtime.step.run_step`) calls, for every optimizer step::

    step_started(ctx)
      phase_started(ctx, INPUT)     ... phase_ended(ctx, INPUT)      ctx.batch is on the device
      phase_started(ctx, LOSS)                                       the user's loss callable runs
        phase_started(ctx, FORWARD) ... phase_ended(ctx, FORWARD)    each call of the root model;
                                                                     ctx.output is its output
      ... phase_ended(ctx, LOSS)                                     ctx.loss is set
      phase_started(ctx, BACKWARD)  ... phase_ended(ctx, BACKWARD)   grads unscaled (and clipped);
                                                                     ctx.grad_norm when clip made it
      phase_started(ctx, OPTIMIZER) ... phase_ended(ctx, OPTIMIZER)  step, scaler update, scheduler
    step_ended(ctx)

`ctx.phase` always names the innermost phase under way, so a probe that sees operators
(the tracer) knows where each one ran. A user's loop followed through hooks
(`runtime.hooks.StepHooks`) announces the same phases, with two differences a probe may
meet: a phase can end several times in one step (gradient accumulation: several
forwards, losses and backwards), and BACKWARD ends when `backward()` returns, before
the user unscales, so the gradients still carry the loss scale (`ctx.grad_scale`).

A probe must not change the math unless it is a patch (the what-if replays); it installs
what it needs in `__enter__` and removes all of it in `__exit__`, exceptions included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from nandoctor.runtime.state import TrainingObjects


class Phase(str, Enum):
    """Where in a step a value was produced, as SPEC.md names it."""

    INPUT = "input"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    PARAMETERS = "parameters"  # non-finite before the step began


@dataclass
class StepContext:
    """What one step has produced so far; probes read it, only the driver writes it.

    `session` holds the training objects: nandoctor's `Session`, or the `HookedRun` the
    hooks discovered in a user's loop.
    """

    session: TrainingObjects
    step: int
    batch: Any
    phases: list[Phase] = field(default_factory=list)
    output: Any = None
    loss: torch.Tensor | None = None  # the loss that ended the last LOSS phase
    grad_norm: torch.Tensor | None = None  # the norm clipping measured, when it ran
    # NB: the loss scale the gradients still carry when BACKWARD ends: None where the step
    # unscaled them first (`run_step`); a user's loop unscales after backward, if ever
    grad_scale: torch.Tensor | None = None
    micro_batch: int | None = None  # gradient accumulation: the micro-batch under way
    # NB: with several losses in a step (accumulation): True where each is the part a
    # user's loop backpropagates (`loss / accum`, as trainers write it), so the step's
    # loss is their sum; in nandoctor's own step each is a micro-batch's whole loss, and
    # the step's is their mean
    losses_add_up: bool = False
    # NB: the step's losses come from `optimizer.step(closure)` (L-BFGS): after the first,
    # the optimizer may already have moved the weights within the step
    closure: bool = False
    # NB: followed loops (`StepHooks`): an optimizer stepped, or a GradScaler decided to
    # skip its step; False after a call of `guard.step` that only accumulated gradients
    stepped: bool = False

    @property
    def phase(self) -> Phase | None:
        return self.phases[-1] if self.phases else None

    def step_loss(self, losses: list[float]) -> float:
        """The step's loss from its losses' values (`losses_add_up`: their sum, else their
        mean), as the telemetry records it and a replay checks it."""
        total = sum(losses)
        return total if self.losses_add_up else total / len(losses)


class Probe:
    """Base class: every hook is a no-op; a probe overrides the ones it needs.

    `forward_phase`: the probe is told of the FORWARD phase (each call of the root
    model, its output in `ctx.output`). Announcing it puts hooks on the model for the
    step, which a probe that ignores the phase does not need to pay for.
    """

    forward_phase = True

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step_started(self, ctx: StepContext) -> None:
        pass

    def phase_started(self, ctx: StepContext, phase: Phase) -> None:
        pass

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        pass

    def step_ended(self, ctx: StepContext) -> None:
        pass


class Probes(Probe):
    """Several probes notified in order (and exited in reverse order)."""

    def __init__(self, *probes: Probe) -> None:
        self.probes = [p for p in probes if p is not None]
        self.forward_phase = any(p.forward_phase for p in self.probes)

    def __enter__(self) -> Probes:
        for p in self.probes:
            p.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.probes):
            p.__exit__(*exc)

    def step_started(self, ctx: StepContext) -> None:
        for p in self.probes:
            p.step_started(ctx)

    def phase_started(self, ctx: StepContext, phase: Phase) -> None:
        for p in self.probes:
            p.phase_started(ctx, phase)

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        for p in self.probes:
            p.phase_ended(ctx, phase)

    def step_ended(self, ctx: StepContext) -> None:
        for p in self.probes:
            p.step_ended(ctx)

    def step_aborted(self, ctx: StepContext) -> None:
        """The run ended inside the step (`StepHooks.abort`): each probe that judges such a
        step (the sentinel, the tracer) does."""
        for p in self.probes:
            aborted = getattr(p, "step_aborted", None)
            if aborted is not None:
                aborted(ctx)
