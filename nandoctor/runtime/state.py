"""The training objects, as one typed protocol that every driver of a step satisfies.

nandoctor builds a run itself (`setup.session.Session`) or follows a user's own loop
through hooks (`runtime.hooked.HookedRun`, which discovers the objects as they run). The
sentinel, the snapshots, the localisation and the report read the same few attributes
from either; this protocol is that contract, so neither side needs a stand-in or a
`type: ignore` to be passed where the other is expected.

The members are read-only properties: a `Session` always has a model, a hooked run may
not have met it yet, and both fit `nn.Module | None`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class TrainingObjects(Protocol):
    """What a training step is made of, whoever built it."""

    @property
    def model(self) -> nn.Module | None: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def scaler(self) -> torch.amp.GradScaler | None: ...

    @property
    def scheduler(self) -> Any | None: ...

    @property
    def device(self) -> torch.device | None: ...

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype of the forward (float32 when autocast is off)."""
        ...

    @property
    def params(self) -> list[nn.Parameter]:
        """The trainable parameters the optimizer steps."""
        ...

    @property
    def others(self) -> list[nn.Module]:
        """The other root modules the loop trains (a GAN's discriminator), if any."""
        ...

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer known to step (a GAN's two); `optimizer` is among them."""
        ...

    @property
    def start_step(self) -> int:
        """The number of the first step (a resumed run does not start at 0)."""
        ...

    @property
    def clip_grad_norm(self) -> float | None:
        """The max_norm gradients are clipped to, if any."""
        ...

    @property
    def clipped_scaled(self) -> int | None:
        """The first step that clipped gradients the GradScaler still scaled, if any."""
        ...


def device_of(objects: TrainingObjects) -> torch.device:
    """Where the step runs: the objects' device, else their parameters' (a hooked run learns
    its device at the model's first forward), else the CPU."""
    if objects.device is not None:
        return objects.device
    params = objects.params
    return params[0].device if params else torch.device("cpu")


def model_and_optimizer(objects: TrainingObjects) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The two objects a snapshot or a replay cannot do without. A `Session` and a `Guard`
    know them from the start; a hooked run once its loop has stepped."""
    model, optimizer = objects.model, objects.optimizer
    if model is None or optimizer is None:
        raise LookupError("the model and the optimizer are not known yet: no step has run")
    return model, optimizer


def stepped_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    """What an optimizer steps, by the parameters' ids. NB: a loop that re-creates its
    optimizer (to lower its rate each epoch, say) steps the same parameters with a new
    one, which then numbers the steps: the old one never steps again; an optimizer and a
    wrapper of it (accelerate's) step the same."""
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


__all__ = ["TrainingObjects", "device_of", "model_and_optimizer", "stepped_ids"]
