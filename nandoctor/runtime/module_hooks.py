"""How `StepHooks` sees module calls: PyTorch's global module hooks while they are needed,
the model's own calls alone once they say the same (the light mode), and nothing of its
own while a compiled module runs.

Global module hooks make every module call of the process take PyTorch's slow path (a few
microseconds each: measured, ~0.14 ms of a 6 ms convnet step). So once the model is known
(its calls seen at its class: `runtime.calls`, `followed`) and `LIGHT_AFTER` steps in a row
ran no root forward but the model's own, the global module hooks come off, and the
model's calls alone announce the same phases. A step that ran another root module
(`head(backbone(x))`, a GAN), or a framework's named batch, keeps the global hooks for
good; a root module that first appears after the switch is not announced as a FORWARD of
its own (its output shows in the loss all the same)::

    COUNTING ── LIGHT_AFTER steps whose only root forward was the model ──► LIGHT
    COUNTING ── a step with another root forward, or a batch named ──────► KEPT
    (LIGHT and KEPT are final; a step with no root forward counts for neither)

Whatever the mode, the global hooks are on exactly while the hooks are attached, the mode
is not LIGHT, and no compiled module's call is under way: torch.compile warns about any
global module hook at each call of its module, and would trace them into its graph.
Attached again after a detach, they resume in the mode they had (the light one included).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from torch import nn

from nandoctor.runtime import global_hooks

LIGHT_AFTER = 2  # steps with the model as their only root forward, before the light hooks


class HookMode(Enum):
    COUNTING = "counting"  # the global hooks, counting the steps the model ran alone
    KEPT = "kept"  # the global hooks, for good: another root module was met
    LIGHT = "light"  # the model's calls alone: no global module hook


class ModuleHooks:
    """The global module hooks `pre` and `post` (with kwargs, always called), installed
    and removed as the module docstring says; `followed`: the model, once its calls are
    seen at its class."""

    def __init__(self, pre: Callable[..., Any], post: Callable[..., Any]) -> None:
        self._pre, self._post = pre, post
        self._handles: list[global_hooks.Handle] = []
        self.mode = HookMode.COUNTING
        self.followed: nn.Module | None = None
        self.attached = False
        self.compiled = 0  # compiled modules' calls under way: the global hooks stand aside
        self.regular = 0  # steps whose only root forward was the model
        self.step_regular: bool | None = None  # this step's, once it has a root forward

    # -- attach / detach ------------------------------------------------------------------
    def attach(self) -> None:
        self.attached = True
        if self.mode is not HookMode.LIGHT:
            self._install()

    def detach(self) -> None:
        global_hooks.remove(self._handles)
        self.attached, self.compiled = False, 0

    def _install(self) -> None:
        self._handles = [
            global_hooks.module_forward_pre(self._pre),
            # NB: one post hook, not two: every module call pays each global hook
            global_hooks.module_forward(self._post, with_kwargs=True, always_call=True),
        ]

    # -- compiled modules -----------------------------------------------------------------
    def stand_aside(self) -> None:
        """A compiled module's call begins."""
        self.compiled += 1
        if self.compiled == 1:
            global_hooks.remove(self._handles)

    def step_back(self) -> None:
        """A compiled module's call ended."""
        self.compiled = max(0, self.compiled - 1)
        wanted = self.attached and self.mode is not HookMode.LIGHT
        if not self.compiled and wanted and not self._handles:
            self._install()

    # -- the mode ---------------------------------------------------------------------------
    def root_forward(self, of_model: bool) -> None:
        """A root forward began in this step: the model's own (`of_model`) or another's."""
        self.step_regular = of_model and self.step_regular is not False

    def keep(self) -> None:
        """A framework names each batch: the light hooks would see the model's calls only."""
        if self.mode is HookMode.COUNTING:
            self.mode = HookMode.KEPT

    def step_abandoned(self) -> None:
        self.step_regular = None

    def step_ended(self, model_followed: Callable[[], bool]) -> bool | None:
        """Count the step that ended; its regularity (None: it had no root forward)."""
        regular, self.step_regular = self.step_regular, None
        if self.mode is not HookMode.COUNTING:
            return regular
        if regular is False:  # another root module: its calls need the global hooks
            self.mode = HookMode.KEPT
        elif regular and model_followed():
            self.regular += 1
            if self.regular >= LIGHT_AFTER:
                global_hooks.remove(self._handles)
                self.mode = HookMode.LIGHT
        return regular


__all__ = ["LIGHT_AFTER", "HookMode", "ModuleHooks"]
