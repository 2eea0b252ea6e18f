"""Recheck a watched run's GradScaler skips at loss scale 1, in a rerun of the command.

`diagnose` rewinds to a skipped step and runs it again at loss scale 1; a script cannot
be rewound, so the first run's skips are "unchecked" and only a collapse of the scale
fails it, often long after the scaler began hiding a NaN (a `log` of a softmax zero whose
backward is 0/0 at any scale, skipped at scattered steps while the loss stays finite).
When such a collapse ends the run, `watch` reruns the command with `recheck_steps`, the
steps that were skipped: at each, the backward keeps its graph (`wrappers.keep_graph_when`)
and, once it returns, the same step's gradients are recomputed from the unscaled loss,
that is at loss scale 1, without touching the run's own (`torch.autograd.grad` adds
nothing to `.grad`, and the scaled backward the loop ran stays the one it steps on). A
skipped step whose gradients are non-finite there too is the failure the scaler hid.

Not in a job of several ranks: the recomputed backward would run the gradient hooks of a
data-parallel wrapper a second time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from nandoctor.report.telemetry import Event, Telemetry
from nandoctor.runtime import wrappers
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.judge import hidden_failure
from nandoctor.runtime.probe import Probe, StepContext
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.tensors import nonfinite
from nandoctor.runtime.verdict import OVERFLOW, UNCHECKED, Reading

# (step, the rerun skipped it too, its gradients were non-finite at loss scale 1)
Checked = Callable[[int, bool, bool], None]


def _false(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bool, device=device)


class SkipRecheck(Probe):
    """At each of `steps`, the gradients of every backward's unscaled losses, checked;
    `checked(step, skipped, bad)` is told as the step ends: whether the rerun skipped the
    step too (its scaled gradients non-finite, as the first run's were: a script that
    is not deterministic does not), and whether they are non-finite at loss scale 1. A
    probe for the steps, and a listener of `wrappers` for the losses a GradScaler scales,
    as they are (the hooks' are detached)."""

    forward_phase = False

    def __init__(self, run: HookedRun, steps: list[int], checked: Checked) -> None:
        self.run, self.steps, self.checked = run, set(steps), checked
        self._step: int | None = None
        self._losses: list[torch.Tensor] = []
        self._scaled: list[torch.Tensor] = []  # NB: per backward: its scaled gradients' flag
        self._flags: list[torch.Tensor] = []

    def __enter__(self) -> SkipRecheck:
        wrappers.register(self)
        wrappers.keep_graph_when(self._keeps)
        return self

    def __exit__(self, *exc: object) -> None:
        wrappers.unkeep(self._keeps)
        wrappers.unregister(self)

    def _keeps(self) -> bool:
        return self._step in self.steps

    # -- the probe: which step -------------------------------------------------------------
    def step_started(self, ctx: StepContext) -> None:
        self._step, self._losses, self._scaled, self._flags = ctx.step, [], [], []

    def step_ended(self, ctx: StepContext) -> None:
        if self._step in self.steps and self._flags:
            skipped = bool(torch.stack(self._scaled).any())
            self.checked(ctx.step, skipped, bool(torch.stack(self._flags).any()))

    # -- the listener: the losses, and their backward ------------------------------------------
    def scaled(self, scaler: torch.amp.GradScaler, loss: torch.Tensor, out: torch.Tensor) -> None:
        if self._keeps():
            # NB: unscaled (the scale multiplies it after); every one since the last backward:
            # `(scaler.scale(l1) + scaler.scale(l2)).backward()` backwards both
            self._losses.append(loss)

    def backward_ended(self, ok: bool) -> None:
        losses, self._losses = self._losses, []
        live = [loss for loss in losses if loss.requires_grad]
        if not ok or not live:
            return
        params = self._params()
        scaled = [p.grad for p in params if p.grad is not None]
        device = live[0].device
        self._scaled.append(nonfinite(scaled, device) if scaled else _false(device))
        # NB: the graph kept for this, freed after, unless the loop backwards through it again
        keep = wrappers.asked_to_retain()
        total = torch.stack([loss.float().reshape(()) for loss in live]).sum()
        grads = torch.autograd.grad(total, params, allow_unused=True, retain_graph=keep)
        present = [g for g in grads if g is not None]
        self._flags.append(nonfinite(present, device) if present else _false(device))

    def _params(self) -> list[torch.nn.Parameter]:
        """Every trainable weight the loop may have backwarded into: its optimizers' and its
        root modules' (a GAN's generator, before its optimizer ever stepped)."""
        seen = {id(p): p for p in self.run.params if p.requires_grad}
        for module in [self.run.model, *self.run.others]:
            if module is not None:
                seen.update((id(p), p) for p in module.parameters() if p.requires_grad)
        return list(seen.values())

    def backward_started(self, tensors: Any) -> None:
        pass

    def optimizer_entered(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        pass

    def optimizer_exited(self, optimizer: torch.optim.Optimizer, ok: bool) -> None:
        pass

    def clipped(self, max_norm: float | None) -> None:
        pass

    def unscaled(self) -> None:
        pass


# -- the runner's side: which skips to recheck, and what the answers make of the run ------
def steps_to_recheck(result: RunResult) -> list[int]:
    """The unchecked skips of a run that a collapse of the scale ended (none otherwise:
    a healthy run's skips are the scale calibrating, not worth a rerun of the command)."""
    if result.failure is None or not result.failure.collapsed_unchecked:
        return []
    return [e.step for e in _skips(result) if e.reason == UNCHECKED]


def with_answers(result: RunResult, answers: dict[int, bool]) -> RunResult:
    """The run as the rechecks found it: each rechecked skip an overflow, or, at the first
    whose gradients were non-finite at loss scale 1 too, the failure the scaler hid (the
    run judged up to it, as `diagnose` stops there)."""
    hidden = min((s for s, bad in answers.items() if bad), default=None)
    events = [
        replace(e, reason=OVERFLOW)
        if e.kind == "scaler-skip" and answers.get(e.step) is False
        else e
        for e in result.events
    ]
    if hidden is None:
        failure = result.failure
        if failure is not None and all(answers.get(e.step) is False for e in _skips(result)):
            failure = replace(failure, unchecked=False)  # NB: every skip an overflow
        return replace(result, events=events, failure=failure)
    return _failed_at(replace(result, events=events), hidden)


def _skips(result: RunResult) -> list[Event]:
    return [e for e in result.events if e.kind == "scaler-skip"]


def _failed_at(result: RunResult, step: int) -> RunResult:
    t = result.telemetry
    kept = [i for i, s in enumerate(t.step) if s <= step]
    telemetry = Telemetry(
        [t.step[i] for i in kept],
        [t.loss[i] for i in kept],
        [t.grad_norm[i] for i in kept],
        [t.scale[i] for i in kept],
    )
    at = kept[-1] if kept and t.step[kept[-1]] == step else None
    reading = Reading(
        step=step,
        params_before=False,
        input=False,
        forward=False,
        loss_bad=False,
        grads=True,
        params=False,
        loss=t.loss[at] if at is not None else math.nan,
        grad_norm=t.grad_norm[at] if at is not None else math.nan,
        scale=t.scale[at] if at is not None else None,
    )
    return replace(
        result,
        failure=hidden_failure(reading, " (rechecked in a rerun of the command)"),
        telemetry=telemetry,
        events=[e for e in result.events if e.step < step],
        steps_run=len(kept),
    )
