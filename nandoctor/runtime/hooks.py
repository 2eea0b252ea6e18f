"""Drive the probes of `nandoctor.runtime.step` from a training loop nandoctor did not write.

`runtime.step.run_step` announces each phase of a step to a probe. A user's own loop announces
nothing, so `StepHooks` reconstructs the same announcements from PyTorch's global hooks
(module forwards, optimizer steps) and the few wrappers of `runtime.wrappers` (backward,
GradScaler, clipping)::

    model(x) with grad enabled        step_started (first event of a step)
                                      INPUT (the model's inputs, positional and
                                      keyword), LOSS opens,
                                      FORWARD opens ... FORWARD ends (its output)
    loss.backward() / scaler.scale(loss).backward()
                                      LOSS ends (ctx.loss, unscaled), BACKWARD opens
                                      ... BACKWARD ends when backward returns (the
                                      grads are final for this micro-batch, and carry
                                      the loss scale: ctx.grad_scale); the phase
                                      stays BACKWARD for unscale_ and clipping
    optimizer.step() / scaler.step()  OPTIMIZER ... OPTIMIZER ends, then step_ended:
                                      one step per step of the first optimizer seen
                                      (the clock), at the step of the loop's last
                                      optimizer (below)

The model is the outermost module that runs with grad enabled and owns trainable
parameters (a parameterless `nn.CrossEntropyLoss` belongs to the loss phase); when the
model is given (`Guard`), its own first call, even inside a wrapper it was not given as
(`nn.DataParallel(model)`): the wrapper only hands it the batch (a step that trains
without calling it at all gets a warning, once: the loop calls a compiled or an
unrelated module). Another such module called outside it (`head(backbone(x))`, a GAN's
`D(G(z))`) is a FORWARD of its own, never the INPUT: its arguments are the model's
outputs, not the batch. Forwards under `no_grad` (evaluation) and recomputations inside
backward (checkpointing) are not steps. With gradient accumulation a step announces each
forward, loss and backward (`runtime.sentinel` adds them up). `optimizer.step(closure)`
runs the closure's forward and backward inside the step; its OPTIMIZER phase is
announced after them. In `explicit` mode (`Guard.step`) the caller opens and closes each
step and names its batch; optimizer steps then only mark the OPTIMIZER phase.

A loop with several optimizers (a GAN's discriminator and generator, each stepped once an
iteration) is one step an iteration: the step holds one step of the clock and ends at the
step of the optimizer that stepped last before the clock stepped again (learned then,
once: before it, the first iteration's work after the clock's step counts toward the
next step). A loop that later breaks that order (the clock steps again before the last
one did) has its steps end at the clock's from there on. A `Guard`'s hooks, given their
own optimizer, end each step at its step alone: each guard of a GAN counts its own.

A loop that steps no optimizer (`watch` only: it updates its weights by hand,
`p.data.add_(p.grad, alpha=-lr)`) has no optimizer step to end a step: one ends when the
model is called again after a backward whose gradients the loop has reset since
(`zero_grad()`), and the last one when the script ends (`finish`). Accumulated gradients
are not reset, so the micro-batches before a first optimizer step stay one step.

Nothing is put on the user's objects: `torch.save(model)` pickles whatever a model holds
(a hook included) and `copy.deepcopy(model)` copies it. PyTorch's global forward pre-hook
sees a call's positional arguments only, and `model(**batch)` passes all of its batch by
keyword; so once the model is known its calls are seen at its class (`runtime.calls`),
with their keywords: from the start when it is given (`Guard`), else from the end of its
first call on (`watch` meets the model only then), whose keyword inputs are checked when
it returns, before its output is, which the probes judge the same way (the sentinel by
phase, the tracer names no origin before the loss). A `torch.compile`d module's calls are
seen so too, and the global module hooks stand aside while one runs: torch.compile warns
about any global module hook at each call of its module, and would trace them into its
graph.

Global module hooks slow every module call down, so once the model's own calls are all
a step runs they come off (the light mode: `runtime.module_hooks`), in `explicit` mode
too: `Guard.step` keeps one `StepHooks` across its steps, attached for each step alone.
What the hooks remember between calls is kept by concern, each part's transitions
written down where it is defined (`runtime.hook_state`).

Everything here is host-side bookkeeping; the probe decides what runs on the device.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from nandoctor.runtime import amp, calls, global_hooks, wrappers
from nandoctor.runtime.hook_state import (
    CallsUnderWay,
    GradMark,
    Grads,
    ScaledLoss,
    StepEnd,
    StepSoFar,
)
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.module_hooks import ModuleHooks
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.tensors import call_inputs

ContextCallback = Callable[[StepContext], None]

# Said once, when a step clips gradients that still carry the loss scale (the report's
# clip-before-unscale says it again, with a failure)
CLIP_BEFORE_UNSCALE = (
    "step {step} clipped the gradients before scaler.unscale_(optimizer): the "
    "clip compared its threshold with the norm times the loss scale (65536 at the start), "
    "so every update is that much smaller than meant; call scaler.unscale_(optimizer) "
    "right before clip_grad_norm_ (clip-before-unscale)"
)


class StepHooks:
    """Attach with `with StepHooks(run, probe):`; `probe` may be swapped between steps."""

    def __init__(
        self,
        run: HookedRun,
        probe: Probe,
        *,
        model: nn.Module | None = None,
        explicit: bool = False,
        start_step: int = 0,
        on_step_start: ContextCallback | None = None,
        on_step_end: ContextCallback | None = None,
        on_model: Callable[[], None] | None = None,
        warn: bool = True,
    ) -> None:
        """`warn=False`: nandoctor's own rerun of a step, whose warnings about the loop
        (a model it never calls) the loop's run has said already."""
        self.run, self.probe, self.explicit = run, probe, explicit
        self.step = start_step
        self.ctx: StepContext | None = None
        self.on_step_start, self.on_step_end = on_step_start, on_step_end
        # NB: told when the model's first forward makes it known: in a step that opened
        # before it (`optimizer.step(closure)`), after on_step_start
        self.on_model = on_model
        self._model_ids = {id(m) for m in model.modules()} if model is not None else None
        # NB: the given model's name, until a step trained without calling it (said once)
        self._given = type(model).__name__ if model is not None and warn else None
        self._is_model_cache: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._warn = warn
        self._optimizer_handles: list[global_hooks.Handle] = []
        self.modules = ModuleHooks(self._pre, self._post)
        self.under_way = CallsUnderWay()
        self.progress = StepSoFar()
        self.ending = StepEnd()
        self._scaled: ScaledLoss | None = None  # `scaler.scale(loss)`, until its backward
        self._named: Any = None  # the next step's batch, named by a framework's callback

    # -- attach / detach -------------------------------------------------------------
    def __enter__(self) -> StepHooks:
        """Attach; attached again after `__exit__`, it resumes where it left off (the
        light hooks included)."""
        self._optimizer_handles = [
            global_hooks.optimizer_step_pre(self._optimizer_pre),
            global_hooks.optimizer_step_post(self._optimizer_post),
        ]
        self.modules.attach()
        calls.follow_compiled(self)
        model = self.modules.followed or self.run.model
        if model is not None:
            self._follow(model)
        wrappers.register(self)
        return self

    def __exit__(self, *exc: object) -> None:
        wrappers.unregister(self)
        calls.unfollow(self)
        self.modules.detach()
        global_hooks.remove(self._optimizer_handles)

    def _follow(self, model: nn.Module) -> None:
        """The model's calls, seen at its class from now on (`runtime.calls`): with their
        keyword inputs, and nothing put on the model (a compiled one is seen so already)."""
        if not calls.followed(model, self):
            calls.follow(model, self)
        self.modules.followed = model

    def name_batch(self, batch: Any) -> None:
        """The next step's whole batch, when a framework hands it over before the step
        (Lightning's `on_train_batch_start`): it is that step's INPUT, labels included,
        which the model's own inputs (`self.net(x)` inside `training_step`) may not be."""
        self._named = batch
        self.modules.keep()  # NB: the light hooks see the model's calls only

    # -- explicit steps (Guard.step) ------------------------------------------------------
    def begin(self, batch: Any) -> StepContext:
        ctx = self._open(batch)
        self._phase(ctx, Phase.INPUT, batch)
        return ctx

    def end(self) -> None:
        if self.ctx is not None:
            self._close()

    def abort(self) -> int | None:
        """The run ends in the middle of a step (the user's code raised and nothing caught
        it): the probe judges what the step saw (`step_aborted`: the sentinel's, the
        tracer's). The step's number, if one was under way."""
        ctx, aborted = self.ctx, getattr(self.probe, "step_aborted", None)
        self.abandon()
        if ctx is not None and aborted is not None:
            aborted(ctx)
        return ctx.step if ctx is not None else None

    def abandon(self) -> None:
        """The user's step raised: forget the half-done step and every call under way."""
        self.ctx, self._scaled = None, None
        self.under_way.reset()
        self.modules.step_abandoned()

    # -- module forwards ------------------------------------------------------------------
    def _pre(self, module: nn.Module, args: Any) -> None:
        """A global hook, before any module call the model's class does not announce."""
        if torch.compiler.is_compiling():  # NB: keeps the hooks out of compiled graphs
            return
        if module is not self.modules.followed:
            self._entered(module, args, None)

    def _post(self, module: nn.Module, args: Any, *rest: Any) -> None:
        """After a module call: (kwargs, output), or (output,) when its forward raised
        (NB: torch calls an always-called hook without the keywords then)."""
        if torch.compiler.is_compiling() or module is self.modules.followed:
            return
        kwargs, output = rest if len(rest) == 2 else ({}, rest[0])
        self._exited(module, args, kwargs, output)

    def call_started(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """A call of the model, or of a compiled module (`calls.Follower`): the global
        hooks stand aside for a compiled one (torch.compile warns about any, and would
        trace them into its graph), which then counts as one module call."""
        if calls.compiled(module):
            self.modules.stand_aside()
        self._entered(module, args, kwargs)

    def call_ended(
        self, module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> None:
        self._exited(module, args, kwargs, output)
        if calls.compiled(module):
            self.modules.step_back()

    def _entered(self, module: nn.Module, args: Any, kwargs: dict[str, Any] | None) -> None:
        """Before a module call; `kwargs` None: a global hook's, which sees no keywords."""
        under_way = self.under_way
        depth, under_way.depth = under_way.depth, under_way.depth + 1
        # NB: the model's first call, not the outermost module's: a wrapper the caller did
        # not name (`nn.DataParallel(model)`, a module holding it) only passes it the batch
        if under_way.root_at is not None:
            if under_way.sniff:
                under_way.sniff = not self.run.note_inner_autocast()
            return
        if self._compiles_the_given(module):
            module = module.get_submodule("_orig_mod")  # NB: the model given, compiled
        if under_way.backward or not torch.is_grad_enabled() or not self._is_model(module):
            return
        known, undecided = self.run.model is not None, self.run.dtype is None
        self.run.note_model(module)  # NB: before the step opens, so its probes know the model
        if not known and self.on_model is not None:
            self.on_model()
        if module is self.run.model and self._stepless_due():
            self._close()  # NB: the loop reset its gradients: the next step begins
            if not self.modules.attached:  # NB: the step's end took the hooks off (`--continue`)
                return
        ctx = self._current()
        if ctx is None:
            return
        under_way.root_at, self.progress.worked = depth, True
        if ctx.phase is not Phase.LOSS:  # NB: a loss begins, its batch next
            self._next_micro_batch(ctx)
        under_way.sniff = undecided and self.run.dtype_from_weights
        self.modules.root_forward(module is self.run.model)
        if self.explicit:  # the caller named the batch
            self._forward_started(ctx)
        elif self._named is not None:  # a framework named it
            batch, self._named = self._named, None
            self._phase(ctx, Phase.INPUT, batch)
            self._forward_started(ctx)
        elif module is not self.run.model:  # another root module (`head(backbone(x))`,
            self._forward_started(ctx)  # a GAN's D(G(z))): its arguments are not the batch
        elif kwargs is not None:  # without a named batch, the model's inputs are the batch
            self._phase(ctx, Phase.INPUT, call_inputs(args, kwargs))
            self._forward_started(ctx)
        else:  # a global hook's: the keyword inputs are checked when the call returns
            self._phase(ctx, Phase.INPUT, args)
            under_way.late = True
            self._forward_started(ctx)

    def _next_micro_batch(self, ctx: StepContext) -> None:
        """A loss begun after a backward, no optimizer step between them, is the next
        micro-batch of gradient accumulation (numbered from 0; a step that had one is
        unnumbered again when it ends: `Tracer.step_ended`)."""
        micro, after_backward = ctx.micro_batch, self.progress.loss_began()
        ctx.micro_batch = 0 if micro is None else micro + after_backward

    def _forward_started(self, ctx: StepContext) -> None:
        if ctx.phase is not Phase.LOSS:
            ctx.phases[:] = [Phase.LOSS]
            self.probe.phase_started(ctx, Phase.LOSS)
        ctx.phases.append(Phase.FORWARD)
        self.probe.phase_started(ctx, Phase.FORWARD)

    def _exited(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        ctx, under_way = self.ctx, self.under_way
        depth = under_way.depth = max(0, under_way.depth - 1)  # the depth this call ran at
        if under_way.root_at is None or depth != under_way.root_at or ctx is None:
            return
        if under_way.late:  # the first call's keyword inputs, before its output
            under_way.late = False
            if kwargs and ctx.phase is Phase.FORWARD:
                self._phase(ctx, Phase.INPUT, call_inputs(args, kwargs))
        under_way.root_ended()
        if ctx.phase is Phase.FORWARD:
            ctx.output = output
            self.probe.phase_ended(ctx, Phase.FORWARD)
            ctx.phases.pop()
            ctx.output = None  # NB: the probe has queued its check; do not hold the graph
        if module is self.run.model and self.modules.followed is None:
            self._follow(module)  # NB: its next calls come with their keyword inputs

    def _compiles_the_given(self, module: nn.Module) -> bool:
        """`module` is `torch.compile(model)` of the model given (not given compiled)."""
        ids = self._model_ids
        return ids is not None and id(module) not in ids and calls.compiled(module)

    def _is_model(self, module: nn.Module) -> bool:
        if self._model_ids is not None:
            return id(module) in self._model_ids
        known = self._is_model_cache.get(module)
        if known is None:
            known = any(p.requires_grad for p in module.parameters())
            self._is_model_cache[module] = known
        return known

    # -- backward, the GradScaler, clipping (wrappers.StepListener) -------------------------
    def backward_started(self, tensors: Any) -> None:
        self.under_way.backward += 1
        ctx = self._current() if self.under_way.backward == 1 else None
        if ctx is None:
            return
        self.progress.worked = True
        loss, scale = self._loss_of(tensors)
        if loss is not None:
            ctx.loss = loss  # this micro-batch's: the probe adds up a step's losses
            self.probe.phase_ended(ctx, Phase.LOSS)
        ctx.grad_scale = scale
        self.progress.backwarded, self.progress.grads = True, Grads.after_backward(scale)
        ctx.phases[:] = [Phase.BACKWARD]
        self.probe.phase_started(ctx, Phase.BACKWARD)

    def backward_ended(self, ok: bool) -> None:
        self.under_way.backward = max(0, self.under_way.backward - 1)
        ctx = self.ctx
        if not self.under_way.backward and ok and ctx is not None and ctx.phase is Phase.BACKWARD:
            self.probe.phase_ended(ctx, Phase.BACKWARD)  # the phase stays open for unscale_
            if self._stepless():
                self.progress.grad_mark = GradMark.of(self.run.params)

    def _loss_of(self, tensors: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The unscaled loss behind the tensor given to backward, and its loss scale."""
        t = tensors
        if isinstance(t, (list, tuple)) and len(t) == 1:
            t = t[0]
        scaled, self._scaled = self._scaled, None
        if not isinstance(t, torch.Tensor):
            return None, None
        if scaled is not None and scaled.of(t):
            return scaled.loss.detach().float().reshape(()), scaled.scale
        return (t.detach().float().reshape(()) if t.numel() == 1 else None), None

    def scaled(self, scaler: torch.amp.GradScaler, loss: torch.Tensor, out: torch.Tensor) -> None:
        self.run.note_scaler(scaler)
        self._scaled = ScaledLoss(weakref.ref(out), loss, amp.scale_tensor(scaler))

    def clipped(self, max_norm: float | None) -> None:
        ctx = self.ctx
        if ctx is None:
            return
        self.run.clip_grad_norm = max_norm
        if self.progress.grads is Grads.SCALED and self.run.clipped_scaled is None:
            self.run.clipped_scaled = ctx.step
            if self._warn:
                said = CLIP_BEFORE_UNSCALE.format(step=ctx.step)
                warnings.warn(f"nandoctor: {said}", stacklevel=4)

    def unscaled(self) -> None:
        self.progress.grads = Grads.UNSCALED

    # -- optimizer steps ------------------------------------------------------------------
    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_entered(optimizer, None)

    def _optimizer_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.optimizer_exited(optimizer, True)

    def optimizer_entered(self, optimizer: torch.optim.Optimizer, scaler: Any) -> None:
        depth, self.under_way.optim = self.under_way.optim, self.under_way.optim + 1
        ctx = self._current() if depth == 0 else None
        if ctx is None:
            return
        self.run.note_optimizer(optimizer, stepping=True)
        if not self.explicit and optimizer is self.run.clock:
            ctx = self._clock_entered(ctx)
        if not self.progress.worked:  # optimizer.step(closure): forward and backward inside
            ctx.closure = True
            return
        ctx.phases[:] = [Phase.OPTIMIZER]
        self.probe.phase_started(ctx, Phase.OPTIMIZER)

    def optimizer_exited(self, optimizer: torch.optim.Optimizer, ok: bool) -> None:
        self.under_way.optim = max(0, self.under_way.optim - 1)
        ctx = self.ctx
        if self.under_way.optim or ctx is None:
            return
        if not ok:
            self.abandon()
            return
        if ctx.phase is not Phase.OPTIMIZER:
            ctx.phases[:] = [Phase.OPTIMIZER]
            self.probe.phase_started(ctx, Phase.OPTIMIZER)
        self.probe.phase_ended(ctx, Phase.OPTIMIZER)
        ctx.phases.clear()
        ctx.stepped = True
        progress = self.progress
        progress.backwarded = False  # NB: the next loss is another model's (a GAN's)
        if self.explicit:
            return
        self.ending.last = optimizer
        progress.clocked = progress.clocked or optimizer is self.run.clock
        if progress.clocked and self.ending.ends_step(optimizer, self.run.clock):
            self._close()

    def _clock_entered(self, ctx: StepContext) -> StepContext:
        """The clock begins to step: at its second step, the optimizer that stepped just
        before it ends every step from now on (the clock itself in a loop with one). A step
        the clock already stepped in ends here instead: the loop broke that order, and the
        clock alone ends steps again (NB: numbered as if it always had)."""
        self.ending.clock_entered(self.run.clock, self.run.given_optimizer)
        if not self.progress.clocked:
            return ctx
        self.ending.order_broken()
        self._close()
        return self._open(None)

    # -- steps ------------------------------------------------------------------------------
    def _current(self) -> StepContext | None:
        """The step under way; outside `explicit` mode, any training event opens one."""
        if self.ctx is None and not self.explicit:
            return self._open(None)
        return self.ctx

    def _stepless(self) -> bool:
        """A loop that has stepped no optimizer (`watch` only: a Guard is given one)."""
        return not self.explicit and self.run.clock is None and self.run.given_optimizer is None

    def _stepless_due(self) -> bool:
        """A loop that updates its weights by hand (`p.data.add_(p.grad, alpha=-lr)`, no
        optimizer) has no optimizer step to end a step: one ends when the model is called
        again after a backward whose gradients the loop has reset since (`zero_grad()`).
        Gradient accumulation keeps them."""
        mark = self.progress.grad_mark
        if mark is None or self.ctx is None or self.under_way.optim or not self._stepless():
            return False
        return mark.reset()

    def finish(self) -> int | None:
        """The script ends: a step of a loop that steps no optimizer ends with it (the
        model is not called again); its number, if one did."""
        ctx = self.ctx
        if ctx is None or self.progress.grad_mark is None or not self._stepless():
            return None
        self._close()
        return ctx.step

    def _open(self, batch: Any) -> StepContext:
        self.progress = StepSoFar()
        ctx = StepContext(self.run, self.step, batch, losses_add_up=True)
        if self.on_step_start is not None:
            self.on_step_start(ctx)
        self.ctx = ctx
        self.probe.step_started(ctx)
        return ctx

    def _close(self) -> None:
        ctx, self.ctx = self.ctx, None
        assert ctx is not None
        ctx.phases.clear()
        self.probe.step_ended(ctx)
        self.step += 1
        regular = self.modules.step_ended(self._model_followed)
        if regular is None and self.progress.worked and self._given is not None:
            self._model_not_called()
        if self.on_step_end is not None:
            self.on_step_end(ctx)

    def _model_followed(self) -> bool:
        model = self.run.model
        return model is not None and calls.followed(model, self)

    def _model_not_called(self) -> None:
        """The step trained without a call of the model it was given: the loop calls
        another module, or calls it inside a function compiled whole (`torch.compile(fn)`,
        whose inner calls no hook sees), so the step has no forward and, unless named, no
        batch. Said once. (A compiled module of the model, `torch.compile(model)`, is
        followed as the model.)"""
        warnings.warn(
            f"nandoctor: step {self.step - 1} trained without calling the model the guard "
            f"was given ({self._given}); give the guard the module your loop calls: it "
            "follows that module's calls and takes their inputs as the batch (inside a "
            "function compiled whole, torch.compile(fn), no call is seen: compile the "
            "model instead, torch.compile(model))",
            stacklevel=2,
        )
        self._given = None

    def _phase(self, ctx: StepContext, phase: Phase, batch: Any) -> None:
        ctx.phases.append(phase)
        ctx.batch = batch
        self.probe.phase_started(ctx, phase)
        self.probe.phase_ended(ctx, phase)
        ctx.phases.pop()
