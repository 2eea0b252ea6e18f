"""Module tracking for the tracer: which module is running now, and how large each
module's activations and gradients got during the step.

Forward hooks on every module of the model (not global hooks: only the user's model, with
its `named_modules()` paths) keep a stack of module paths. The output of each module gets
a tensor hook, so its gradient (the module's grad_output) is measured in backward. The
magnitudes accumulate on the device and are read once, in `stats()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from nandoctor.report.evidence import ModuleStat
from nandoctor.runtime.sharded import class_name
from nandoctor.runtime.tensors import floating


class ModuleTracker:
    def __init__(
        self,
        model: torch.nn.Module,
        quiet: Callable[[], Any] = contextlib.nullcontext,
        enabled: bool = True,  # False: track the current module only, measure nothing
    ) -> None:
        self.model = model
        self.enabled = enabled
        self._quiet = quiet  # the tracer must not trace our own measurements
        self.stack: list[str] = []
        self._handles: list[Any] = []
        self._acts: dict[str, torch.Tensor] = {}  # [finite absmax, nonfinite count]
        self._grads: dict[str, torch.Tensor] = {}
        self._types: dict[str, str] = {}
        self._dtypes: dict[str, str] = {}

    @property
    def current(self) -> str | None:
        """The innermost module running now; None outside the model."""
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> ModuleTracker:
        for name, module in self.model.named_modules():
            self._types[name] = class_name(module)  # FSDP: the user's class, not FSDP<Name>
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name), always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(name)

        return hook

    def _post(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            if not self.enabled:
                return
            with self._quiet():
                for t in floating(output):
                    self._dtypes.setdefault(name, str(t.dtype).removeprefix("torch."))
                    _accumulate(self._acts, name, t)
                    if t.requires_grad:
                        t.register_hook(self._grad(name))

        return hook

    def _grad(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            with self._quiet():
                _accumulate(self._grads, name, grad)

        return hook

    def stats(self) -> list[ModuleStat]:
        """Every module that ran, largest activation first (one host read)."""
        names = list(self._acts)
        if not names:
            return []
        with self._quiet():
            return self._read(names)

    def _read(self, names: list[str]) -> list[ModuleStat]:
        zero = torch.zeros(2, device=next(iter(self._acts.values())).device)
        acts = torch.stack([self._acts[n] for n in names]).tolist()
        grads = torch.stack([self._grads.get(n, zero).to(zero.device) for n in names]).tolist()
        out = [
            ModuleStat(
                module=n,
                type=self._types.get(n, "?"),
                dtype=self._dtypes.get(n),
                activation_absmax=a[0],
                activation_nonfinite=a[1] > 0,
                gradient_absmax=g[0] if n in self._grads else None,
                gradient_nonfinite=g[1] > 0,
            )
            for n, a, g in zip(names, acts, grads, strict=True)
        ]
        return sorted(out, key=lambda m: -(m.activation_absmax or 0.0))


def _accumulate(table: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> None:
    x = t.detach()
    if x.numel() == 0:
        return
    finite = torch.isfinite(x)
    absmax = torch.where(finite, x.abs(), torch.zeros((), dtype=x.dtype, device=x.device)).max()
    entry = torch.stack([absmax.float(), (~finite).sum().float()])
    old = table.get(name)
    table[name] = (
        entry if old is None else torch.stack([torch.maximum(old[0], entry[0]), old[1] + entry[1]])
    )
