"""Module tracking for the tracer: which module is running now, and how large each
module's activations and gradients got during the step.

Forward hooks on every module of the model (not global hooks: only the user's model, with
its `named_modules()` paths) keep a stack of module paths. A loop that trains other root
modules (a GAN's second model) has them tracked too, each module's path inside its own
root, and the root's index beside it (0: the model). The output of each module gets a
tensor hook, so its gradient (the module's grad_output) is measured in backward. The
magnitudes accumulate on the device and are read once, in `stats()`, root by root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from nandoctor.report.evidence import ModuleStat
from nandoctor.runtime.sharded import class_name
from nandoctor.runtime.tensors import floating

ModuleKey = tuple[int, str]  # a module: its root's index (0: the model) and its path inside it


class ModuleTracker:
    def __init__(
        self,
        model: torch.nn.Module,
        quiet: Callable[[], Any] = contextlib.nullcontext,
        enabled: bool = True,  # False: track the current module only, measure nothing
        others: Sequence[torch.nn.Module] = (),  # the step's other root modules
    ) -> None:
        self.model = model
        self.roots = [model, *others]
        self.enabled = enabled
        self._quiet = quiet  # the tracer must not trace our own measurements
        self.stack: list[ModuleKey] = []
        self._handles: list[Any] = []
        self._hooked: set[int] = set()  # the modules hooked (ids)
        self._acts: dict[ModuleKey, torch.Tensor] = {}  # [finite absmax, nonfinite count]
        self._grads: dict[ModuleKey, torch.Tensor] = {}
        self._types: dict[ModuleKey, str] = {}
        self._dtypes: dict[ModuleKey, str] = {}

    @property
    def current(self) -> str | None:
        """The innermost module running now, its path inside its root; None outside."""
        return self.stack[-1][1] if self.stack else None

    @property
    def current_root(self) -> int:
        """The root that module is in (0: the model, also outside any)."""
        return self.stack[-1][0] if self.stack else 0

    def __enter__(self) -> ModuleTracker:
        for root, top in enumerate(self.roots):
            self._hook(root, top)
        return self

    def track(self, others: Sequence[torch.nn.Module]) -> None:
        """Root modules the step met after the tracker went on (a GAN's second model,
        first called in the traced step): tracked from their next call."""
        for top in others[len(self.roots) - 1 :]:
            self.roots.append(top)
            self._hook(len(self.roots) - 1, top)

    def _hook(self, root: int, top: torch.nn.Module) -> None:
        for name, module in top.named_modules():
            if id(module) in self._hooked:  # NB: a root inside another (the model's own)
                continue
            self._hooked.add(id(module))
            key = (root, name)
            self._types[key] = class_name(module)  # FSDP: the user's class, not FSDP<Name>
            self._handles.append(module.register_forward_pre_hook(self._pre(key)))
            self._handles.append(module.register_forward_hook(self._post(key), always_call=True))

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self.stack.clear()

    def _pre(self, name: ModuleKey) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self.stack.append(name)

        return hook

    def _post(self, name: ModuleKey) -> Callable[..., None]:
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

    def _grad(self, name: ModuleKey) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            with self._quiet():
                _accumulate(self._grads, name, grad)

        return hook

    def stats(self, root: int = 0) -> list[ModuleStat]:
        """Every module of `root` that ran, largest activation first (one host read)."""
        names = [key for key in self._acts if key[0] == root]
        if not names:
            return []
        with self._quiet():
            return self._read(names)

    def _read(self, names: list[ModuleKey]) -> list[ModuleStat]:
        zero = torch.zeros(2, device=next(iter(self._acts.values())).device)
        acts = torch.stack([self._acts[n] for n in names]).tolist()
        grads = torch.stack([self._grads.get(n, zero).to(zero.device) for n in names]).tolist()
        out = [
            ModuleStat(
                module=n[1],
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


def _accumulate(table: dict[ModuleKey, torch.Tensor], name: ModuleKey, t: torch.Tensor) -> None:
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
