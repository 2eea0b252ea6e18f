"""Headroom: how close each module's activations and gradients come to float16's limit.

For every module of the model, the largest finite |x| of its outputs (activations) and of
the gradients flowing into them (grad_output), over the whole run, with the step where
each peak happened. The peaks are kept on the device (`torch.maximum` and `torch.where`,
no host read) and read once at the end, so the probe adds kernels but no synchronisation.
Used by `compare` and `baseline`; not by the sentinel's fast path.

In a float16 run only float16 tensors count: what autocast keeps in float32 (the loss, an
embedding's output, and the loss's gradient, which is the GradScaler's scale itself:
65536 at the start) never has to fit in float16. Any other run measures every floating
tensor, as a forecast of what float16 would have to hold.

    blocks.3.mlp.fc2  activation 65504 (100% of float16's range) at step 411
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from nandoctor.report.health import Headroom
from nandoctor.runtime.probe import Probe, StepContext
from nandoctor.runtime.sharded import class_name
from nandoctor.runtime.tensors import floating


class _Peak:
    """A running max of finite |x| and the step that set it, on the device."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.step: torch.Tensor | None = None

    def update(self, t: torch.Tensor, step: torch.Tensor) -> None:
        x = t.detach()
        if x.numel() == 0:
            return
        peak = torch.where(
            torch.isfinite(x), x.abs(), torch.zeros((), dtype=x.dtype, device=x.device)
        )
        peak = peak.max().float()
        if self.value is None or self.step is None:
            self.value, self.step = peak, step.clone()
            return
        higher = peak > self.value
        self.value = torch.maximum(self.value, peak)
        self.step = torch.where(higher, step, self.step)


class HeadroomProbe(Probe):
    forward_phase = False  # NB: its own hooks see every module's output

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
        self.model = model
        self._only = dtype if dtype == torch.float16 else None  # NB: the run's dtype
        self._acts: dict[str, _Peak] = {}
        self._grads: dict[str, _Peak] = {}
        self._types = {name: class_name(m) for name, m in model.named_modules()}
        self._sizes = {
            name: sum(p.numel() for p in m.parameters(recurse=False))
            for name, m in model.named_modules()
        }
        self._handles: list[Any] = []
        self._step = torch.zeros((), dtype=torch.int64)

    def __enter__(self) -> HeadroomProbe:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_hook(self._on_output(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def step_started(self, ctx: StepContext) -> None:
        # NB: a device tensor filled without a host read; the peaks' steps point at it
        self._step = torch.full((), ctx.step, dtype=torch.int64, device=ctx.session.device)

    def _on_output(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            for t in floating(output):
                if self._only is not None and t.dtype != self._only:
                    continue
                self._acts.setdefault(name, _Peak()).update(t, self._step)
                if t.requires_grad:
                    step = self._step
                    t.register_hook(
                        lambda g, s=step: self._grads.setdefault(name, _Peak()).update(g, s)
                    )

        return hook

    def peaks(self) -> list[Headroom]:
        """Every module that ran, closest to float16's limit first (one host read)."""
        names = [n for n, p in self._acts.items() if p.value is not None]
        if not names:
            return []
        values = _read([self._acts[n] for n in names])
        grads = _read([self._grads.get(n) or _Peak() for n in names])
        out = [
            Headroom(n, self._types.get(n, "?"), a[0], a[1], g[0], g[1], order, self._sizes.get(n))
            for order, (n, a, g) in enumerate(zip(names, values, grads, strict=True))
        ]
        return sorted(out, key=lambda h: -h.peak_fraction)


def _read(peaks: list[_Peak]) -> list[tuple[Any, Any]]:
    present = [p.value for p in peaks if p.value is not None]
    if not present:
        return [(None, None)] * len(peaks)
    device = present[0].device
    no_value = torch.tensor(float("nan"), device=device)
    no_step = torch.tensor(-1, dtype=torch.int64, device=device)
    values = torch.stack([p.value if p.value is not None else no_value for p in peaks]).tolist()
    steps = torch.stack([p.step if p.step is not None else no_step for p in peaks]).tolist()
    return [
        (None, None) if p.value is None else (v, int(s))
        for p, v, s in zip(peaks, values, steps, strict=True)
    ]
