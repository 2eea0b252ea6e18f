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
    """A running max of finite |x| and the step that set it, on the device; and the first
    step whose values held a non-finite one (-1: none yet), which the max leaves out."""

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.step: torch.Tensor | None = None
        self.first_nonfinite: torch.Tensor | None = None

    def update(self, t: torch.Tensor, step: torch.Tensor) -> None:
        x = t.detach()
        if x.numel() == 0:
            return
        finite = torch.isfinite(x)
        peak = torch.where(finite, x.abs(), torch.zeros((), dtype=x.dtype, device=x.device))
        peak = peak.max().float()
        bad = ~finite.all()
        if self.value is None or self.step is None or self.first_nonfinite is None:
            self.value, self.step = peak, step.clone()
            self.first_nonfinite = torch.where(bad, step, torch.full_like(step, -1))
            return
        higher = peak > self.value
        self.value = torch.maximum(self.value, peak)
        self.step = torch.where(higher, step, self.step)
        first = bad & (self.first_nonfinite < 0)
        self.first_nonfinite = torch.where(first, step, self.first_nonfinite)


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
            Headroom(
                n, self._types.get(n, "?"), a[0], a[1], g[0], g[1], order, self._sizes.get(n), a[2]
            )
            for order, (n, a, g) in enumerate(zip(names, values, grads, strict=True))
        ]
        return sorted(out, key=lambda h: -h.peak_fraction)


def went_nonfinite_in(peaks: list[Headroom], step: int) -> Headroom | None:
    """The module where a forward that went non-finite at `step` did: the first, in the
    forward's order, whose output held a non-finite value for the first time then. Its
    finite peak says nothing (an output that overflowed is all inf: a peak of 0%).

    NB: first for the module, not only at `step`: a module that outputs -inf every step
    (an additive mask it builds) went non-finite at step 0, harmlessly; at a failure of
    step 0 it is named all the same."""
    broke = [h for h in peaks if h.nonfinite_step == step]
    return min(broke, key=lambda h: h.order, default=None)


def _read(peaks: list[_Peak]) -> list[tuple[Any, Any, Any]]:
    """Each peak's value, its step and its first non-finite step (None where there is
    none), in one host read (float64 holds the steps exactly)."""
    rows = [
        torch.stack([p.value.double(), p.step.double(), p.first_nonfinite.double()])
        for p in peaks
        if p.value is not None and p.step is not None and p.first_nonfinite is not None
    ]
    read = iter(torch.stack(rows).tolist() if rows else [])
    out: list[tuple[Any, Any, Any]] = []
    for p in peaks:
        if p.value is None:
            out.append((None, None, None))
            continue
        value, step, first = next(read)
        out.append((value, int(step), int(first) if first >= 0 else None))
    return out
