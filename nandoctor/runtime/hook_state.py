"""What `StepHooks` remembers between PyTorch's calls, one part per concern, and every
way each part changes (the module hooks' own mode is `runtime.module_hooks`).

    CallsUnderWay  the calls under way: module depth, the model's call (its depth, whether
                   its keyword inputs are checked when it returns, whether its modules look
                   for an autocast), backward and optimizer nesting. Each call in, each
                   call out; all back to none when the user's step raised.

    StepSoFar      what the open step did; a fresh one as each step opens.
                   worked      a root forward or a backward ran
                   backwarded  a backward ran since the step's last loss began: set by a
                               backward, cleared by the next loss (the next micro-batch of
                               gradient accumulation) and by an optimizer step (the next
                               loss is another model's: a GAN)
                   clocked     the clock (the first optimizer seen) stepped
                   grads       Grads, below
                   grad_mark   a loop that steps no optimizer: its last backward's
                               gradient, to tell when the loop resets it (`GradMark`)

    Grads          what the step's gradients carry, as GradScaler's `OptState` keeps it per
                   optimizer::

                       NONE ── backward ──► PLAIN (no loss scale) or SCALED
                       any ─── scaler.unscale_ ──► UNSCALED
                       (each backward starts over; each step opens at NONE)

                   clipping SCALED gradients is the clip-before-unscale mistake

    StepEnd        which optimizer's step ends a step of a loop that does not say, learned
                   once, at the clock's second step::

                       learning ── clock steps again ──► the optimizer that stepped just
                                                         before it (the clock itself in a
                                                         loop with one)
                       (a step the clock steps in twice breaks the order: the clock again;
                       a Guard given its optimizer learns none: the clock is that one)

    ScaledLoss     `scaler.scale(loss)` seen: the unscaled loss and its scale, until
                   backward is called on that output (any other backward drops it)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn


@dataclass
class CallsUnderWay:
    depth: int = 0  # module calls under way
    root_at: int | None = None  # the module depth of the model's call under way, if one is
    # NB: the model's first call under way, without autocast: its modules look for one
    # entered inside its forward (`HookedRun.note_inner_autocast`)
    sniff: bool = False
    late: bool = False  # this forward's keyword inputs are checked when it returns
    backward: int = 0  # backward calls under way
    optim: int = 0  # optimizer steps under way (GradScaler.step wraps optimizer.step)

    def root_ended(self) -> None:
        self.root_at, self.late, self.sniff = None, False, False

    def reset(self) -> None:
        """The user's step raised: no call is under way any more."""
        self.depth = self.backward = self.optim = 0
        self.root_ended()


class Grads(Enum):
    NONE = "none"  # no backward yet in this step
    PLAIN = "plain"  # a backward without a loss scale
    SCALED = "scaled"  # a backward of a scaled loss: the gradients carry its scale
    UNSCALED = "unscaled"  # `scaler.unscale_` ran since the last backward

    @staticmethod
    def after_backward(scale: torch.Tensor | None) -> Grads:
        return Grads.PLAIN if scale is None else Grads.SCALED


@dataclass(frozen=True)
class GradMark:
    """A gradient of a loop that steps no optimizer, as its last backward left it: the loop
    reset its gradients since (`zero_grad()`: set to None, or zeroed in place) when the
    parameter holds another gradient or this one changed (NB: plain tensors only: a
    DTensor's version is not its shard's)."""

    param: torch.Tensor
    grad: weakref.ref[torch.Tensor]
    version: int

    @staticmethod
    def of(params: list[nn.Parameter]) -> GradMark | None:
        for p in params:
            g = p.grad
            if g is not None and type(g) is torch.Tensor:
                return GradMark(p, weakref.ref(g), g._version)
        return None

    def reset(self) -> bool:
        now, then = self.param.grad, self.grad()
        if now is None or then is None or now is not then:
            return True
        return now._version != self.version


@dataclass
class StepSoFar:
    worked: bool = False
    backwarded: bool = False
    clocked: bool = False
    grads: Grads = Grads.NONE
    grad_mark: GradMark | None = None

    def loss_began(self) -> bool:
        """A loss begins; whether a backward came before it (with no optimizer step
        between them: the next micro-batch of gradient accumulation)."""
        after, self.backwarded = self.backwarded, False
        return after


@dataclass
class StepEnd:
    last: torch.optim.Optimizer | None = None  # the last optimizer that stepped
    closer: torch.optim.Optimizer | None = None  # its step ends a step (None: the clock's)
    learned: bool = False  # the closer was learned (once)

    def clock_entered(
        self, clock: torch.optim.Optimizer | None, given: torch.optim.Optimizer | None
    ) -> None:
        """The clock begins to step: learn the closer, unless a Guard's own optimizer was
        given (it ends each step at its step alone)."""
        if not self.learned and self.last is not None and given is None:
            self.learned = True
            self.closer = None if self.last is clock else self.last

    def order_broken(self) -> None:
        self.closer = None

    def ends_step(
        self, optimizer: torch.optim.Optimizer, clock: torch.optim.Optimizer | None
    ) -> bool:
        return optimizer is (self.closer or clock)


@dataclass(frozen=True)
class ScaledLoss:
    out: weakref.ref[torch.Tensor]  # what `scaler.scale(loss)` returned
    loss: torch.Tensor
    scale: torch.Tensor | None

    def of(self, tensor: torch.Tensor) -> bool:
        return self.out() is tensor


__all__ = ["CallsUnderWay", "GradMark", "Grads", "ScaledLoss", "StepEnd", "StepSoFar"]
