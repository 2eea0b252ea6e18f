"""The one training step. Every run (the fast watch, the instrumented replay, the what-if
replays, compare) goes through `run_step`; a probe sees each phase boundary.

The step is the loop users write, with the order that matters spelled out::

    with autocast(dtype):            loss = loss_fn(model, batch)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)       # always before clipping: clip the true gradients
    clip_grad_norm_(params, max)     # only when the config asks for it
    scaler.step(optimizer); scaler.update(); scheduler.step()

With `grad_accum_steps: N`, the first three lines run once per micro-batch, the loss
divided by N, and `unscale_` and clipping once, after the last.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from nandoctor.errors import ConfigError, kind_of
from nandoctor.runtime import amp
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.tensors import to_device
from nandoctor.setup.data import MicroBatches
from nandoctor.setup.scaler import check_master_weights
from nandoctor.setup.session import Session
from nandoctor.setup.user_code import user_code


def run_step(session: Session, step: int, batch: Any, probe: Probe) -> StepContext:
    """One optimizer step; a `MicroBatches` batch (gradient accumulation) runs input, loss
    and backward once per micro-batch, each loss divided by their number, then unscales,
    clips and steps once (`ctx.micro_batch` says which one is under way)."""
    parts = batch.batches if isinstance(batch, MicroBatches) else (batch,)
    ctx = StepContext(session, step, batch)
    session.optimizer.zero_grad(set_to_none=True)  # NB: first: no gradient is carried over
    probe.step_started(ctx)
    for index, part in enumerate(parts):
        ctx.micro_batch = index if isinstance(batch, MicroBatches) else None
        _forward_backward(session, ctx, probe, part, last=index == len(parts) - 1)
    with _Phase(ctx, probe, Phase.OPTIMIZER):
        _optimizer_step(session, ctx)
    probe.step_ended(ctx)
    return ctx


def _forward_backward(
    session: Session, ctx: StepContext, probe: Probe, batch: Any, *, last: bool
) -> None:
    with _Phase(ctx, probe, Phase.INPUT):
        ctx.batch = to_device(batch, session.device)
    forward = _forward_phases(ctx, probe, session.model) if probe.forward_phase else _NO_HOOKS
    with _Phase(ctx, probe, Phase.LOSS), forward, session.autocast():
        with user_code(f"loss (step {ctx.step})"):
            loss = session.loss_fn(session.train_model or session.model, ctx.batch)
        ctx.loss = _checked_loss(loss, ctx.batch)
    with _Phase(ctx, probe, Phase.BACKWARD):
        _backward(session, ctx, last=last)
    ctx.output = None  # NB: drop the graph's outputs now, not when ctx goes away


def _backward(session: Session, ctx: StepContext, *, last: bool) -> None:
    """Backpropagate this (micro-)batch's share of the loss; after the last, unscale and
    clip the accumulated gradients once. Until then they still carry the loss scale."""
    assert ctx.loss is not None
    scaler, parts = session.scaler, session.config.grad_accum_steps
    loss = ctx.loss / parts if parts > 1 else ctx.loss
    with user_code(f"backward (step {ctx.step})"):
        (scaler.scale(loss) if scaler else loss).backward()
    if not last:
        ctx.grad_scale = amp.scale_tensor(scaler)
        return
    ctx.grad_scale = None
    if scaler is not None:
        try:
            scaler.unscale_(session.optimizer)
        except ValueError:  # NB: float16 weights, made so after the check before the run
            check_master_weights(session.config.precision, session.optimizer, session.model)
            raise
    max_norm = session.config.clip_grad_norm
    if max_norm is not None:
        _refuse_sparse_gradients(session)
        ctx.grad_norm = torch.nn.utils.clip_grad_norm_(session.params, max_norm)


def _refuse_sparse_gradients(session: Session) -> None:
    """`clip_grad_norm_` cannot take a norm of sparse gradients (torch's NotImplementedError
    for 'SparseCPU'): say which, and what to do."""
    sparse = [p for p in session.params if p.grad is not None and p.grad.is_sparse]
    if sparse:
        names = {id(p): n for n, p in session.model.named_parameters()}
        raise ConfigError(
            f"clip_grad_norm: torch.nn.utils.clip_grad_norm_ cannot clip sparse gradients "
            f"({', '.join(names.get(id(p), '?') for p in sparse[:3])}: an "
            "nn.Embedding(sparse=True)?); set clip_grad_norm: null, or make them dense "
            "(sparse=False)"
        )


def _optimizer_step(session: Session, ctx: StepContext) -> None:
    with user_code("optimizer step"):
        if session.scaler is not None:
            session.scaler.step(session.optimizer)
            session.scaler.update()
        else:
            session.optimizer.step()
    if session.scheduler is not None:
        _scheduler_step(session.scheduler, ctx)


def _scheduler_step(scheduler: Any, ctx: StepContext) -> None:
    with user_code("scheduler step"), warnings.catch_warnings():
        # NB: when the scaler skips the first step, torch warns that the scheduler stepped
        # before the optimizer; that is the normal order of an fp16 loop, not a user error.
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            assert ctx.loss is not None  # the loss phase ran before the optimizer's
            scheduler.step(ctx.loss.detach())
        else:
            scheduler.step()


def _checked_loss(loss: Any, batch: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"loss: returned {kind_of(loss)}, expected a scalar torch.Tensor",
            hint=_not_a_tensor_hint(loss, batch),
        )
    if loss.numel() != 1:
        raise ConfigError(
            f"loss: returned a tensor of shape {list(loss.shape)}, expected a scalar",
            hint="reduce it, e.g. with .mean()",
        )
    if not loss.requires_grad:
        raise ConfigError("loss: the returned tensor does not require grad (is it detached?)")
    if loss.is_complex() or loss.is_meta:  # NB: no real value to judge or backpropagate
        what = "a complex" if loss.is_complex() else "a meta-device (valueless)"
        raise ConfigError(f"loss: returned {what} tensor, expected a real scalar with a value")
    return loss if loss.dim() == 0 else loss.reshape(())  # NB: no view (and no node) to add


def _not_a_tensor_hint(loss: Any, batch: Any) -> str | None:
    """The usual ways a loss function returns something else, transformers' first."""
    unlabelled = isinstance(batch, Mapping) and "labels" not in batch
    if (loss is None or hasattr(loss, "loss")) and unlabelled:
        keys = ", ".join(repr(k) for k in batch)
        return (
            "a transformers model's .loss is None unless the batch holds 'labels'; "
            f"this batch holds {keys}"
        )
    if hasattr(loss, "loss"):  # a ModelOutput
        return "that is the model's output: return its .loss (`model(**batch).loss`)"
    if loss is None:
        return "the loss function returned nothing: end it with `return loss`"
    if isinstance(loss, float):
        return "return the loss tensor, not `loss.item()`: the backward needs its graph"
    return None


class _Phase:
    """One phase of the step: announced when it starts, and when it ends unless it raised.
    NB: a class, not a generator: four of them a step, and every step counts."""

    __slots__ = ("ctx", "phase", "probe")

    def __init__(self, ctx: StepContext, probe: Probe, phase: Phase) -> None:
        self.ctx, self.probe, self.phase = ctx, probe, phase

    def __enter__(self) -> None:
        self.ctx.phases.append(self.phase)
        self.probe.phase_started(self.ctx, self.phase)

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            if kind is None:
                self.probe.phase_ended(self.ctx, self.phase)
        finally:
            self.ctx.phases.pop()


_NO_HOOKS = contextlib.nullcontext()


@contextlib.contextmanager
def _forward_phases(ctx: StepContext, probe: Probe, model: torch.nn.Module) -> Iterator[None]:
    """Mark each call of the root model, inside the loss callable, as the forward phase."""

    def pre_hook(module: torch.nn.Module, args: Any) -> None:
        ctx.phases.append(Phase.FORWARD)
        probe.phase_started(ctx, Phase.FORWARD)

    def post_hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        ctx.output = output
        probe.phase_ended(ctx, Phase.FORWARD)
        ctx.phases.pop()

    handles = [model.register_forward_pre_hook(pre_hook), model.register_forward_hook(post_hook)]
    depth = len(ctx.phases)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        del ctx.phases[depth:]  # a forward that raised never reached its post hook
