"""What the hooks learn about a training run they did not build: its `TrainingObjects`.

`diagnose` builds model, optimizer and scaler itself and hands probes a `Session`. Under
`watch` or a `Guard`, the user's script built them; the hooks discover them as they run:
the model at its first forward with grad enabled, the optimizer at its first step, the
GradScaler when it scales a loss. A `HookedRun` holds what was given and what was
discovered, and satisfies `runtime.state.TrainingObjects`, so the sentinel, the
snapshots and the replay take it where they take a `Session`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nandoctor.runtime.state import stepped_ids


@dataclass
class HookedRun:
    model: nn.Module | None = None  # the first model that ran forward with grad enabled
    # NB: the other root modules the loop trains (a GAN's second model, a head called on
    # the model's output): the replay's tracer names module paths inside them too
    others: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)  # given or seen
    clock: torch.optim.Optimizer | None = None  # the first to step: its steps number steps
    # NB: the optimizer a Guard was given: only one stepping its parameters (it, a wrapper
    # of it, or the one it wraps) may be the clock, never another model's (a GAN's)
    given_optimizer: torch.optim.Optimizer | None = None
    scaler: torch.amp.GradScaler | None = None  # an enabled GradScaler that scaled a loss
    scheduler: Any | None = None  # only when given (Guard): no hook reveals one
    device: torch.device | None = None
    dtype: torch.dtype | None = None  # the autocast dtype at the model's first forward
    # NB: no autocast was on at that call: the dtype is the weights' until an autocast
    # entered inside the forward says otherwise (`note_inner_autocast`)
    dtype_from_weights: bool = False
    clip_grad_norm: float | None = None  # the max_norm of the last clip_grad_norm_ call
    # NB: the first step whose clip met gradients the GradScaler still scaled (its
    # unscale_ came after the clip, or never): a threshold compared with 65536x the norm
    clipped_scaled: int | None = None
    start_step: int = 0  # the number of the first step (a resumed loop's Guard says it)
    _params: list[nn.Parameter] = field(default_factory=list, repr=False)
    _params_key: tuple[int, ...] = field(default=(), repr=False)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that numbers the steps (before any step: the first one known)."""
        return self.clock or (self.optimizers[0] if self.optimizers else None)

    @property
    def params(self) -> list[nn.Parameter]:
        """What the optimizers step (every optimizer seen); before any step, the model's."""
        key = tuple(len(g["params"]) for o in self.optimizers for g in o.param_groups)
        if key != self._params_key or not self._params:
            self._params_key = key
            self._params = self._collect_params()
        return self._params

    def _collect_params(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for opt in self.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    seen.setdefault(id(p), p)
        if not seen and self.model is not None:
            seen = {id(p): p for p in self.model.parameters() if p.requires_grad}
        return list(seen.values())

    def note_model(self, module: nn.Module) -> None:
        """The first root module is the model, the others are `others`; at the model's
        first forward, the device and dtype."""
        if self.model is None:
            self.model = module
        elif module is not self.model and all(m is not module for m in self.others):
            self.others.append(module)
        if self.dtype is not None:
            return
        first = next(iter(self.model.parameters()), None)
        if self.device is None:
            self.device = first.device if first is not None else torch.device("cpu")
        autocast = autocast_dtype(self.device)
        self.dtype_from_weights = autocast is None
        self.dtype = autocast or (first.dtype if first is not None else torch.float32)

    def note_inner_autocast(self) -> bool:
        """A module inside the model's first forward, while the dtype is the weights': an
        autocast on now was entered inside the model's forward (accelerate and transformers'
        Trainer wrap `model.forward` in one, after the model's own hooks ran), and it is the
        dtype the run computes in. True once the dtype is settled."""
        dtype = autocast_dtype(self.device or torch.device("cpu"))
        if dtype is None:
            return False
        self.dtype, self.dtype_from_weights = dtype, False
        return True

    def note_optimizer(self, optimizer: torch.optim.Optimizer, stepping: bool = False) -> None:
        """A known optimizer; `stepping`: it is stepping now (the first such is the clock).

        NB: the clock is the first optimizer seen *stepping*, not the one a caller named:
        a wrapper such as accelerate's AcceleratedOptimizer steps through the inner one.
        With a named one, the first that steps its parameters: with two guards on a GAN's
        loop, the generator's guard does not count the discriminator's steps as its own.
        """
        if all(o is not optimizer for o in self.optimizers):
            self.optimizers.append(optimizer)
        if stepping and self.clock is None and self._steps_given(optimizer):
            self.clock = optimizer
        elif stepping and self._made_anew(optimizer):
            self.optimizers = [o for o in self.optimizers if o is not self.clock]
            self.clock = optimizer

    def _made_anew(self, optimizer: torch.optim.Optimizer) -> bool:
        """`optimizer` steps the clock's parameters: the clock made anew by the loop."""
        clock = self.clock
        return (
            clock is not None
            and optimizer is not clock
            and stepped_ids(optimizer) == stepped_ids(clock)
        )

    def _steps_given(self, optimizer: torch.optim.Optimizer) -> bool:
        given = self.given_optimizer
        if given is None or optimizer is given:
            return True
        return not stepped_ids(given).isdisjoint(stepped_ids(optimizer))

    def note_scaler(self, scaler: torch.amp.GradScaler) -> None:
        """An enabled GradScaler scaled a loss (the sentinel's judge then learns its scale)."""
        if scaler.is_enabled():
            self.scaler = scaler


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast casts to on `device` right now; None when it is off."""
    kind = device.type
    if not torch.amp.is_autocast_available(kind) or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)
