"""The cheap watch over hooked steps: the sentinel's flags, read once per step, judged by
the sentinel's own `Judge`.

It differs from `probes.sentinel.Sentinel` only where a user's loop differs from ours:
a step may call the model and backward several times (gradient accumulation), so the
input and forward flags accumulate and a non-finite loss is never overwritten by a later
finite one; the gradients are measured when backward returns, still scaled by the
GradScaler if the loss was, so their norm is divided by that scale (the flag is the same:
a scaled gradient is non-finite exactly when the unscaled one is); and the scaler is
discovered during the run, so the judge learns its scale when it first appears.

Like the sentinel, it queues 0-dim flags on the device and reads one small tensor per
step; on CUDA that read is deferred by a step (pinned memory and an event), so the
verdict of step N arrives when step N+1 ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from nandoctor.report.telemetry import Event
from nandoctor.runtime.fast_run import RunResult
from nandoctor.runtime.hooked import Run
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.sentinel import Judge, Reading, Verdict
from nandoctor.runtime.tensors import floating, nonfinite, total_norm

_FLAGS = ("params_before", "input", "forward", "loss_bad", "grads", "params")
_VALUES = ("loss", "grad_norm", "scale")


class Monitor(Probe):
    """A probe for `StepHooks`; `collect()` yields the verdicts and records them."""

    def __init__(self, run: Run, *, start_step: int = 0, defer: bool | None = None) -> None:
        self.run = run
        self.defer = defer
        self.judge = Judge.for_scaler(run.scaler)
        self.result = RunResult("healthy", start_step, 0)
        self._judged = run.scaler
        self._flags: dict[str, torch.Tensor] = {}
        self._pending: list[tuple[int, torch.Tensor, torch.cuda.Event | None, bool]] = []
        self._params_checked = False
        self._started: float | None = None

    # -- probe hooks: device work only ---------------------------------------------------
    def step_started(self, ctx: StepContext) -> None:
        self._flags = {}
        if self._started is None:
            self._started = time.perf_counter()
        if not self._params_checked and self.run.params:
            self._flags["params_before"] = nonfinite(self.run.params, self._device())
            self._params_checked = True

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        device = self._device()
        if phase is Phase.INPUT:
            self._or("input", nonfinite(floating(ctx.batch), device))
        elif phase is Phase.FORWARD:
            self._or("forward", nonfinite(floating(ctx.output), device))
        elif phase is Phase.LOSS and ctx.loss is not None:
            self._flags["loss"] = ctx.loss.to(device)
            self._flags["loss_bad"] = _bad(self._flags["loss"])
        elif phase is Phase.BACKWARD:
            self._grads_ended(device)
        elif phase is Phase.OPTIMIZER:
            self._flags["params"] = nonfinite(self.run.params, device)

    def _grads_ended(self, device: torch.device) -> None:
        grads = [p.grad for p in self.run.params if p.grad is not None]
        norm = total_norm(grads, device)
        scale = self.run.grad_scale
        if scale is not None:  # NB: clone: GradScaler.update() changes the scale in place
            self._flags["scale"] = scale.detach().to(device, torch.float32).clone()
            norm = norm / self._flags["scale"]
        else:
            self._flags.pop("scale", None)
        self._flags["grad_norm"] = norm
        self._flags["grads"] = nonfinite(grads, device)  # NB: exact; the norm can overflow

    def step_ended(self, ctx: StepContext) -> None:
        device = self._device()
        zero = torch.zeros((), device=device)
        row = [self._flags.get(k, zero).to(device).float().reshape(()) for k in _FLAGS + _VALUES]
        packed = torch.stack(row)
        has_scale = "scale" in self._flags
        if self.defer if self.defer is not None else device.type == "cuda":
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((ctx.step, host, event, has_scale))
        else:
            self._pending.append((ctx.step, packed, None, has_scale))
        self._flags = {}

    # -- host side ----------------------------------------------------------------------
    def collect(self, final: bool = False) -> Iterator[Verdict]:
        """Verdicts of the steps whose readings are ready, each recorded in `result`."""
        deferred = self.defer if self.defer is not None else self._device().type == "cuda"
        keep = 0 if (final or not deferred) else 1
        while len(self._pending) > keep:
            step, values, event, has_scale = self._pending.pop(0)
            if event is not None:
                event.synchronize()
            row = values.tolist()  # NB: the one host read per step
            verdict = self._judge()(_reading(step, row, has_scale))
            self._record(verdict)
            yield verdict

    def _judge(self) -> Judge:
        if self.run.scaler is not self._judged and self.judge.streak == 0:
            self.judge, self._judged = Judge.for_scaler(self.run.scaler), self.run.scaler
        return self.judge

    def _record(self, v: Verdict) -> None:
        r, result = v.reading, self.result
        result.steps_run += 1
        result.seconds = time.perf_counter() - (self._started or time.perf_counter())
        result.telemetry.append(r.step, r.loss, r.grad_norm, r.scale)
        if v.skipped:
            result.events.append(Event(r.step, "scaler-skip", r.scale))
        if v.failed and result.failure is None:
            result.status, result.failure = "nonfinite", v

    def _or(self, key: str, flag: torch.Tensor) -> None:
        self._flags[key] = self._flags[key] | flag if key in self._flags else flag

    def _device(self) -> torch.device:
        if self.run.device is not None:
            return self.run.device
        params = self.run.params
        return params[0].device if params else torch.device("cpu")


def _bad(value: torch.Tensor) -> torch.Tensor:
    return ~torch.isfinite(value)


def _reading(step: int, row: list[float], has_scale: bool) -> Reading:
    flags = dict(zip(_FLAGS, (bool(x) for x in row), strict=False))
    loss, grad_norm, scale = row[len(_FLAGS) :]
    return Reading(
        step=step, loss=loss, grad_norm=grad_norm, scale=scale if has_scale else None, **flags
    )
