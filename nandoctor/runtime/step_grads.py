"""Which gradients are the step's own, as opposed to left over from the step before.

A loop with several backward passes a step (a GAN: the discriminator's loss, then the
generator's) zeroes each optimizer's gradients just before its own backward. So when
the first backward ends, the generator's gradients are still the previous step's: that
step judged them. Judged again they fail a healthy step whenever a GradScaler skipped
the one before (its gradients inf or NaN), and every scale-1 recheck of a skip, which
reruns the step on top of the skipped step's gradients, reads as a real failure.

A gradient is the step's once it is another tensor than the step began with (zero_grad
set it to None, backward made it anew) or the same one written to (its version moved:
accumulated, zeroed or unscaled in place). Nothing is kept alive for it: the step's
start is remembered by weak references, and a loop that sets its gradients to None
first (torch's default, and `run_step`'s) leaves nothing to remember at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


class StepGradients:
    """The gradients the parameters carried when the step began (`begin`), to tell them
    from the ones the step made (`made`, `of`)."""

    __slots__ = ("_carried",)

    def __init__(self) -> None:
        self._carried: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}

    def begin(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The step begins: remember each gradient present and its version.

        NB: plain tensors only. A sharded gradient (FSDP's DTensor) writes into its local
        shard, whose version its wrapper does not show: it always counts as the step's."""
        self._carried = {
            id(p): (weakref.ref(g), g._version)
            for p in params
            if (g := p.grad) is not None and type(g) is torch.Tensor
        }

    def made(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """`p`'s gradient if the step made or changed it, else None."""
        g = p.grad
        if g is None or not self._carried:
            return g
        carried = self._carried.get(id(p))
        if carried is not None and carried[0]() is g and g._version == carried[1]:
            return None
        return g

    def of(self, params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
        """The gradients the step made or changed, in `params`' order."""
        if not self._carried:  # NB: the common case, every step: a loop that zeroes first
            return [g for p in params if (g := p.grad) is not None]
        return [g for p in params if (g := self.made(p)) is not None]


__all__ = ["StepGradients"]
