"""The sentinel: the cheap watch that finds the first bad step of a run, whoever drives it.

At each phase boundary it adds a 0-dim flag to a dict on the device (never reading it);
at the end of the step it stacks flags and telemetry into one small tensor and reads it
on the host: the only synchronisation it adds, once per step. On CUDA even that read is
deferred by a step (a non-blocking copy into pinned memory plus an event), so the host
never waits for the GPU to drain; the verdict of step N arrives after step N+1 was queued.
A rider may add its own device values to that read (`Sentinel.carry`: the forecast's
signals, `runtime.precursors`): they follow the row in the same copy, and come back on
the step's `Reading.carried` (on the CPU, read as the step ends, like the rest).

NB: on a short step every kernel counts (docs/performance.md: 1.03x the plain loop on a
6 ms step leaves the sentinel 0.2 ms), so a value the host can judge is not judged on
the device. The loss's finiteness is read from the loss itself. On the CPU (read at
once, not deferred) the loss is read as its phase ends, and only a non-finite one has
the weights checked right then, before the backward and the update touch them: weights
that were already broken when the step began (changed between steps, or by the update
before) name the PARAMETERS phase, not the loss (elsewhere only the first step's weights
are checked; the replay names the update either way). Each gradient's sum of squares is
taken as the backward ends, while its writes are still in the caches
(`tensors.host_square_sums`: float32 and float64 gradients' dot products, read at once;
fused norms for other kinds), and the gradients' flag is their total's finiteness: a NaN
or inf element makes it NaN or inf, and a finite total proves every element finite. Only
an infinite total is ambiguous (finite values of ~1e19 and up overflow float32 squares):
that step, and only it, gets the exact check, at its end, while the gradients are still
the step's. The batch is judged only in a step that failed (a non-finite batch fails no
step by itself; its flag names the failed step's phase). On CUDA, and in a data-parallel
job (where each rank's flag must be exact before the rows are gathered), one fused
float64 pass gives both, exactly (its squares hold up to 1e154), and the batch is
flagged on the device each step.

The same sentinel watches nandoctor's own step (`runtime.step.run_step`: diagnose,
compare, the what-if replays) and a user's loop followed through hooks
(`runtime.hooks.StepHooks`: Guard, watch). A foreign loop differs in what its driver
announces, and the sentinel's rules already cover both, so it has no mode for it:

- gradients at the end of BACKWARD still carry the GradScaler's scale when the driver
  says so (`ctx.grad_scale`): their norm is divided by it; the finite flag is the same;
- a phase may end several times in a step (gradient accumulation): its flags are OR-ed,
  and a non-finite loss is never overwritten by a later finite one;
- the GradScaler may first appear mid-run: the judge learns its scale when it does;
- the step ends when the driver says so (`step_ended`).

A reading becomes a `Verdict` (`runtime.verdict`) in `Judge` (`runtime.judge`, the rules
of SPEC.md): the sentinel reads, the judge decides.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from nandoctor.runtime import amp
from nandoctor.runtime.judge import Judge, Recheck
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.state import TrainingObjects, device_of
from nandoctor.runtime.step_grads import StepGradients
from nandoctor.runtime.tensors import (
    floating,
    gradient_check,
    host_square_sums,
    nonfinite,
    nonfinite_data,
    square_sums,
    stacked,
    wide_norm,
    without_loss,
)
from nandoctor.runtime.verdict import Reading, Verdict

if TYPE_CHECKING:
    from nandoctor.setup.distributed import Ranks

# The packed reading, in this order: one float64 per slot. The loss's flag is not a slot:
# the host reads it from the loss (`_reading`).
_SLOTS = (  # NB: `_one_rank` unpacks a row in this order
    "params_before",
    "input",
    "forward",
    "local_grads",  # this rank's gradients before the all-reduce (== grads outside DDP)
    "grads",
    "params",
    "loss",
    "grad_norm",
    "scale",
)
# NB: a rank's batch or output that went non-finite made it an origin only through its own
# loss or gradients (a masked NaN heals): the flags a rank raised before the all-reduce
_ORIGIN_SLOTS = ("params_before", "loss_bad", "local_grads")
_SLOT_OF = {key: i for i, key in enumerate(_SLOTS)}
_INPUT, _GRADS, _LOCAL_GRADS = (_SLOTS.index(k) for k in ("input", "grads", "local_grads"))
_GRAD_NORM, _SCALE, _LOSS = (_SLOTS.index(k) for k in ("grad_norm", "scale", "loss"))
_PARAMS_BEFORE, _PARAMS = (_SLOTS.index(k) for k in ("params_before", "params"))


class Sentinel(Probe):
    """Watches every step; `collect()` yields the verdicts as they arrive.

    `ranks`: this process's place in a data-parallel job (every rank's flags are read
    together). `defer`: read each step's flags one step late (None: on CUDA). `thorough`
    also checks the model's output (less the loss it may carry) and the weights after
    each update (two more passes a step): exact phases without a replay, for `compare`.
    `diagnose`, `Guard` and `watch` leave them to the replay, which names the phase
    anyway: a non-finite output shows in the loss, and weights an update broke show at
    the next step, which the replay traces back to that update. `recheck`: how the
    driver reruns a skipped step at loss scale 1 (None: it cannot; skips are unchecked).
    """

    def __init__(
        self,
        objects: TrainingObjects,
        *,
        ranks: Ranks | None = None,
        defer: bool | None = None,
        thorough: bool = False,
        recheck: Recheck | None = None,
    ) -> None:
        self.objects = objects
        self.ranks = ranks
        self.defer = defer
        self.thorough = thorough
        self.forward_phase = thorough  # NB: only `thorough` looks at the model's output
        self.recheck = recheck
        self._flags: dict[str, torch.Tensor] = {}
        self._pending: list[_Pending] = []
        # NB: on the CPU, the step's gradients and their sums of squares (their flag)
        self._grads: list[torch.Tensor] | None = None
        self._squares: list[torch.Tensor] = []
        self._host_squares: list[float] = []  # NB: the same, already read (`host_square_sums`)
        # NB: an earlier backward of the step made non-finite gradients (a loop that zeroed
        # them before the next one, its optimizer step skipped: they count all the same)
        self._earlier_bad = False
        self._losses: list[float] = []  # NB: on the CPU, the step's, read as each is made
        self._loss_parts = 0  # NB: elsewhere, how many losses the kept sum holds
        self._batches: list[object] = []  # the step's, named if it failed in INPUT
        self._updated = False  # an optimizer has stepped in this step
        self._aborted: int | None = None  # the step that raised before it ended
        self._scaled = False  # those sums are of gradients that still carry the loss scale
        self._clipped = False  # the sum is clip's norm, of the gradients before clipping
        self._zeros: dict[torch.device, torch.Tensor] = {}
        self._at_once: tuple[torch.device, bool] | None = None  # `_reads_at_once`, kept
        self._checked_params_once = False
        self._step_grads = StepGradients()  # NB: a GAN's other gradients, still the last step's
        self._judge = Judge.for_scaler(objects.scaler, recheck)
        self._judged_scaler = objects.scaler
        # NB: a rider's values, read with the step's own read (the forecast's signals,
        # `runtime.precursors`): called as the step ends, it gives (a layout, a 1-d tensor
        # on the device) or None; not in a data-parallel run (one row a rank)
        self.carry: Callable[[], tuple[Any, torch.Tensor] | None] | None = None

    # -- probe hooks: device work only -------------------------------------------------
    def step_started(self, ctx: StepContext) -> None:
        self._forget_step()
        params = self.objects.params  # NB: a hooked run may not know them before a step
        self._step_grads.begin(params)
        # NB: the weights once, at the first step (a bad checkpoint); later, an update's
        # effect shows in the next step
        if not self._checked_params_once and params:
            self._flags["params_before"] = nonfinite(params, self._device())
            self._checked_params_once = True

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.INPUT:
            device = self._device()
            self._batches.append(ctx.batch)  # NB: a reference, kept until its step is judged
            if not self._reads_at_once(device):  # NB: on the CPU, judged if the step failed
                self._any("input", nonfinite_data(floating(ctx.batch), device))
        elif phase is Phase.FORWARD and self.thorough:
            output = floating(without_loss(ctx.output))  # its loss is the LOSS phase's
            self._any("forward", nonfinite(output, self._device()))
        elif phase is Phase.LOSS and ctx.loss is not None:
            if self._reads_at_once(self._device()):
                self._loss_read(ctx.loss, ctx.closure)
            else:
                self._loss_ended(ctx.loss.detach())  # NB: its own dtype: float64 stays exact
        elif phase is Phase.BACKWARD:
            self._grads_ended(ctx)
        elif phase is Phase.OPTIMIZER:
            self._updated = True
            if self.thorough:
                self._flags["params"] = nonfinite(self.objects.params, self._device())

    def _loss_ended(self, loss: torch.Tensor) -> None:
        kept = self._flags.get("loss")
        # NB: with several losses in a step (accumulation), the step's is their sum or
        # mean (`StepContext.losses_add_up`), as a trainer logs it: non-finite exactly when
        # one of them is (summed in float64: finite float16 losses never overflow the sum)
        self._flags["loss"] = loss if kept is None else kept.double() + loss.double()
        self._loss_parts += 1

    def _loss_read(self, loss: torch.Tensor, closure: bool = False) -> None:
        """The CPU's way: the loss is read as its phase ends (the one read it costs the step
        anyway), before the backward and the update touch anything. So a non-finite loss
        has the weights it was computed with checked there and then: weights already
        broken when the step began (by the update before, or changed between steps: a
        checkpoint loaded, weights edited in place) name the PARAMETERS phase, not LOSS.
        A healthy step pays nothing for it."""
        value = loss.item()
        self._losses.append(value)
        # NB: not once an optimizer has stepped within the step (a GAN's loop: the other
        # model's update is this step's, not the weights it began with), nor after a
        # closure's first loss (L-BFGS moves the weights between its closure's calls)
        moved = self._updated or (closure and len(self._losses) > 1)
        if not math.isfinite(value) and not moved:
            self._any("params_before", nonfinite(self.objects.params, torch.device("cpu")))

    def _grads_ended(self, ctx: StepContext) -> None:
        device = self._device()
        grads = self._step_grads.of(self.objects.params)
        # NB: sharded (FSDP): this rank's shards; clip's norm is the whole model's, not theirs
        clip_norm = None if self._sharded else ctx.grad_norm
        carried = ctx.grad_scale  # NB: a scaled gradient is non-finite iff the true one is
        if self._reads_at_once(device):  # judged on the host when the step ends
            if self._grads is not None and not self._earlier_bad:  # NB: the rare case
                self._earlier_bad = self._grads_bad(_root_sum(self._read_squares()))
            self._grads, self._scaled = grads, carried is not None
            # NB: measured now, while the backward's writes are still in the caches (after
            # the update they compete with the weights and the optimizer's state). With
            # gradient accumulation each backward's sums replace the last one's: the
            # gradients add up, so the last are the step's norm (their flag is `_any`'s)
            self._squares, self._host_squares = [], []
            self._clipped = clip_norm is not None
            if clip_norm is not None:  # NB: float64: its square root is clip's norm again
                self._squares = [clip_norm.detach().double().square()]
            elif (host := host_square_sums(grads)) is not None:
                self._host_squares = host
            else:
                self._squares = square_sums(grads)
        else:
            norm, bad = gradient_check(grads, device, clip_norm)
            self._flags["grad_norm"] = norm / carried if carried is not None else norm
            self._any("grads", bad)
            local = self.ranks.local_grads_bad() if self.ranks is not None else None
            self._any("local_grads", local if local is not None else bad)
        scale = carried if carried is not None else amp.scale_tensor(self.objects.scaler)
        if scale is not None:  # the scale this step used; update() changes it in place
            self._flags["scale"] = scale.detach().clone()

    def _any(self, key: str, flag: torch.Tensor) -> None:
        """Raise `key` if `flag` is; a phase that ends again in the step only adds to it."""
        kept = self._flags.get(key)
        self._flags[key] = flag if kept is None else kept | flag

    def step_ended(self, ctx: StepContext) -> None:
        device = self._device()
        has_scale = "scale" in self._flags
        extra = self.carry() if self.carry is not None and self.ranks is None else None
        if self._reads_at_once(device):
            row = self._read_now(ctx)
            carried = (extra[0], extra[1].tolist()) if extra is not None else None
            self._pending.append(_Pending(ctx.step, row, None, has_scale, self._batches, carried))
            self._forget_step()
            return
        if self._loss_parts > 1 and not ctx.losses_add_up:
            self._flags["loss"] = self._flags["loss"] / self._loss_parts
        self._loss_parts = 0
        packed = torch.stack([self._slot(k, device) for k in _SLOTS])
        if self.ranks is not None:  # NB: one small all-reduce: every rank sees every rank's row
            packed = self.ranks.gather_rows(packed)
        layout = None
        if extra is not None:  # NB: the rider's values travel in the same read
            layout, packed = extra[0], torch.cat([packed, extra[1].to(packed)])
        if self.defer:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append(_Pending(ctx.step, host, event, has_scale, self._batches, layout))
        else:
            self._pending.append(_Pending(ctx.step, packed, None, has_scale, self._batches, layout))
        self._flags, self._batches = {}, []

    def step_aborted(self, ctx: StepContext) -> None:
        """The step raised before it ended and the run is over (a watched script died in
        it): judge what it saw, its batch included. A non-finite batch is then the
        failure, at this step: a loss that raises on NaN (`nn.BCELoss`) ends the script
        before anything else could show it."""
        self._aborted = ctx.step
        self.step_ended(ctx)

    def _forget_step(self) -> None:
        self._flags, self._grads, self._squares, self._host_squares = {}, None, [], []
        self._batches, self._losses, self._updated, self._earlier_bad = [], [], False, False

    def _read_squares(self) -> list[float]:
        """The last backward's sums of squares, on the host (read there already, mostly)."""
        return _host_values(self._squares) + self._host_squares

    def _read_now(self, ctx: StepContext) -> list[float]:
        """The CPU's reading, read as the step ends: the flags and values the step set and
        the gradients' sums of squares (one per tensor, or clipping's total), which become
        the gradients' norm and their flag here.

        NB: the batch is judged only when the step failed. A non-finite batch fails no
        step by itself (`Judge`): its flag only names the phase of a step whose loss,
        gradients or weights went non-finite, so a healthy step never pays for it. It is
        judged as it is when the step ends: a loss that writes into its batch in place is
        judged after its writes (the replay, which checks the batch as it arrives, names
        the exact origin either way)."""
        flags, losses = self._flags, self._losses
        read = _host_values([*flags.values(), *self._squares])
        row = [0.0] * len(_SLOTS)
        for key, value in zip(flags, read, strict=False):  # NB: the flags' values come first
            row[_SLOT_OF[key]] = value
        read = read[len(flags) :]
        if len(losses) == 1:  # NB: the common case
            row[_LOSS] = losses[0]
        elif losses:  # with several (accumulation): non-finite if one is
            row[_LOSS] = ctx.step_loss(losses)
        if self._grads is not None:
            norm = _root_sum(read + self._host_squares)  # NaN or inf if one is
            bad = self._grads_bad(norm) or self._earlier_bad
            if math.isinf(norm) and not bad and not self._clipped:
                norm = wide_norm(self._grads)  # NB: finite values whose squares overflowed
            row[_GRAD_NORM] = norm / row[_SCALE] if self._scaled else norm
            row[_GRADS] = row[_LOCAL_GRADS] = float(bad)
        if self._batches and (_may_fail(row) or self._aborted is not None):
            batch = [t for b in self._batches for t in floating(b)]
            row[_INPUT] = float(bool(nonfinite_data(batch, torch.device("cpu"))))
        return row

    def _slot(self, key: str, device: torch.device) -> torch.Tensor:
        value = self._flags.get(key)
        if value is None:  # NB: one zero per device, not one per missing slot and step
            value = self._zeros.get(device)
            if value is None:
                value = self._zeros[device] = torch.zeros((), dtype=torch.float64, device=device)
            return value
        return value.double().reshape(())

    def _reads_at_once(self, device: torch.device) -> bool:
        """The CPU's way: the step's reading is read when the step ends (no queue to wait
        for), so the gradients' flag can come from their norms (module docstring)."""
        if self._at_once is None or self._at_once[0] != device:  # NB: asked 4 times a step
            if self.defer is None:
                self.defer = device.type == "cuda"
            at_once = not self.defer and device.type == "cpu" and self.ranks is None
            self._at_once = (device, at_once)
        return self._at_once[1]

    def _grads_bad(self, norm: float) -> bool:
        """The gradients' flag from their norm: NaN or finite settle it; an infinite norm is
        rechecked element by element (finite values beyond ~1e19 overflow its squares)."""
        if not math.isinf(norm):
            return math.isnan(norm)
        return bool(nonfinite(self._grads or [], torch.device("cpu")))

    def _device(self) -> torch.device:
        return device_of(self.objects)

    # -- host side ------------------------------------------------------------------
    def collect(self, final: bool = False) -> Iterator[Verdict]:
        """Verdicts of the steps whose readings are ready; with `final`, of all of them."""
        keep = 0 if (final or not self.defer) else 1
        while len(self._pending) > keep:
            step, values, event, has_scale, batches, carried = self._pending.pop(0)
            if event is not None:
                event.synchronize()
            if isinstance(values, list):  # read when the step ended
                rows = [values]
            elif carried is not None:  # NB: a rider's values after the row, in the same read
                flat = values.tolist()
                rows, carried = [flat[: len(_SLOTS)]], (carried, flat[len(_SLOTS) :])
            else:
                rows = values.reshape(-1, len(_SLOTS)).tolist()  # NB: the one host read per step
            reading = _reading(step, rows, has_scale, self._sharded)
            reading.aborted = step == self._aborted
            reading.carried = carried
            verdict = self._current_judge()(reading)
            if verdict.failed and verdict.phase is Phase.INPUT and verdict.step == step:
                verdict.batches = batches
            yield verdict

    @property
    def _sharded(self) -> bool:
        return self.ranks is not None and self.ranks.sharded

    def _current_judge(self) -> Judge:
        """A hooked run may meet its GradScaler only when it first scales a loss: the judge
        then learns that scaler's scale (never in the middle of a streak of skips)."""
        scaler = self.objects.scaler
        if scaler is not self._judged_scaler and self._judge.streak == 0:
            self._judge, self._judged_scaler = Judge.for_scaler(scaler, self.recheck), scaler
        return self._judge


class _Pending(NamedTuple):
    """A step's reading on its way to the host (`values`: read already on the CPU, else
    the device's row, copied asynchronously on CUDA until `event`)."""

    step: int
    values: torch.Tensor | list[float]
    event: torch.cuda.Event | None
    has_scale: bool
    batches: list[object]
    # a rider's layout (its values follow the row in `values`), or (layout, values) read
    carried: Any = None


def _may_fail(row: list[float]) -> bool:
    """Something `Judge` fails a step on went non-finite in the row's step (its weights
    before it, its loss, gradients or weights): only then can its batch name the phase."""
    return bool(row[_PARAMS_BEFORE] or row[_GRADS] or row[_PARAMS]) or not math.isfinite(row[_LOSS])


def _host_values(values: list[torch.Tensor]) -> list[float]:
    """One-element tensors read on the host in one go (NB: a lone one, a GradScaler's
    scale, is read as it is, without stacking; a float32 step has none: its loss was read
    as it was made, its gradients' sums as the backward ended)."""
    if len(values) == 1:
        return [values[0].item()]
    return stacked(values).tolist() if values else []


def _root_sum(squares: list[float]) -> float:
    """The norm from per-tensor sums of squares: NaN or inf if one is."""
    try:
        return math.sqrt(math.fsum(squares))
    except OverflowError:  # NB: finite float64 squares whose sum exceeds float64
        return math.inf


def _reading(step: int, rows: list[list[float]], has_scale: bool, sharded: bool = False) -> Reading:
    """One reading from every rank's row: a flag is up if any rank raised it (the batch's
    and the output's: any rank the failure began on, when one did). `sharded`: each row's
    gradient norm is its rank's shard's, and the model's is their L2 sum."""
    if len(rows) == 1:
        return _one_rank(step, rows[0], has_scale)
    per_rank = [dict(zip(_SLOTS, row, strict=True)) for row in rows]
    for r in per_rank:  # NB: a step's kept loss is non-finite exactly when one of its was
        r["loss_bad"] = not math.isfinite(r["loss"])
    any_rank = {k: any(r[k] for r in per_rank) for k in (*_SLOTS, "loss_bad")}
    origin = tuple(i for i, r in enumerate(per_rank) if any(r[k] for k in _ORIGIN_SLOTS))
    bad = [i for i, r in enumerate(per_rank) if r["grads"] or r["params"]]
    began = [per_rank[i] for i in origin] or per_rank  # NB: not a rank whose NaN healed
    first = per_rank[0]
    return Reading(
        step=step,
        params_before=any_rank["params_before"],
        input=any(r["input"] for r in began),
        forward=any(r["forward"] for r in began),
        loss_bad=any_rank["loss_bad"],
        grads=any_rank["grads"],
        params=any_rank["params"],
        loss=statistics.fmean(r["loss"] for r in per_rank),
        grad_norm=_shards_norm(per_rank) if sharded else first["grad_norm"],  # DDP: all equal
        scale=first["scale"] if has_scale else None,
        origin_ranks=origin if len(per_rank) > 1 else (),
        inherited_ranks=tuple(i for i in bad if i not in origin) if len(per_rank) > 1 else (),
    )


def _one_rank(step: int, row: list[float], has_scale: bool) -> Reading:
    """`_reading` of a single process: its row as it is (NB: the common case, every step,
    so the slots are read by position, not through a dict)."""
    params_before, input_, forward, _, grads, params, loss, grad_norm, scale = row
    return Reading(
        step=step,
        params_before=bool(params_before),
        input=bool(input_),
        forward=bool(forward),
        loss_bad=not math.isfinite(loss),
        grads=bool(grads),
        params=bool(params),
        loss=loss,
        grad_norm=grad_norm,
        scale=scale if has_scale else None,
    )


def _shards_norm(per_rank: list[dict[str, float]]) -> float:
    return math.sqrt(sum(r["grad_norm"] ** 2 for r in per_rank))


__all__ = ["Sentinel"]
