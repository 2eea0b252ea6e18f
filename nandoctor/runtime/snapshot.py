"""Capture and restore everything a step depends on, so a step can be replayed exactly.

A `StateSnapshot` holds, in host memory, the weights and buffers, the optimizer's state,
the GradScaler's scale and growth tracker, the scheduler's state and the RNG states of
Python, numpy, torch and CUDA. The `SnapshotStore` keeps the two newest snapshots (plus
one pinned where a GradScaler streak began) and every batch since the oldest of them, so
any step since then can be reached: restore the snapshot, re-run the steps up to it.

Policy: `every: auto` snapshots every K steps: K grows with the bytes to copy, so the
copy stays a small part of a step, but never so far that the batches kept since the
older snapshot (two periods' worth) outgrow `AUTO_BATCH_BUDGET` or the state itself,
whichever is larger (large batches beside a large state: an image model's); in a
data-parallel job every rank takes the largest of the ranks' K (their shards and batches
differ in size); `every: N` forces it. Buffers are allocated once and reused, so
capturing costs a copy, not an allocation.

Snapshots read the training objects through `TrainingObjects`, so the same store serves
`diagnose`'s session and a `Guard`'s hooked run.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from nandoctor.errors import out_of_memory
from nandoctor.runtime import amp, sharded
from nandoctor.runtime.state import TrainingObjects, model_and_optimizer, stepped_ids
from nandoctor.runtime.tensors import host_copy, iter_tensors, local, tensor_bytes
from nandoctor.setup.rng import RngState

AUTO_BYTES_PER_STEP = 2 * 2**20  # `auto`: one step between snapshots per this many bytes...
AUTO_MIN_EVERY = 32  # ...at least this many (a copy of a small model's state costs about
# a third of a few-ms step: ~1.3% of a step at this period, ~2.5% at every 16 steps), so a
# replay can still look a few dozen steps back...
AUTO_MAX_EVERY = 64  # ...and at most this many; fewer where the batches kept would
AUTO_BATCH_BUDGET = 2**30  # outgrow this many bytes (or the state's size, if larger)


@dataclass
class StateSnapshot:
    """The training state at the start of `step`, in host memory."""

    step: int = -1
    model: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    scaler: tuple[torch.Tensor | None, torch.Tensor | None] | None = None
    scheduler: dict[str, Any] | None = None
    rng: RngState | None = None
    # where the data stream stood, with the step's kept batch (`setup.data.Position`): a
    # replay that resumes here in a fresh session draws the batches the run drew next
    data: Any = None
    # the optimizer's parameters the model does not hold (a learnable temperature in the
    # loss), by their place among the optimizer's parameters
    unowned: dict[int, torch.Tensor] = field(default_factory=dict)
    # the other root modules and optimizers a followed loop trains (a GAN's discriminator
    # and its optimizer): put back with the rest, or a replay would leave them changed
    others: list[_Other] = field(default_factory=list)
    # the gradients the step began with, where they carry into it (`guard.step` calls that
    # accumulate, stepping the optimizer every few): each parameter's, in `grad_buffers`
    # by place; None: the step begins with none (the loop zeroes them), as restored
    grads: list[tuple[nn.Parameter, str]] | None = None
    grad_buffers: dict[str, Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        kept = [self.model, self.optimizer.get("state", {}), self.unowned]
        grads = self.grad_buffers if self.grads is not None else {}
        return tensor_bytes(kept + [[o.state, o.unowned] for o in self.others] + [grads])

    def capture(self, objects: TrainingObjects, step: int, grads: bool = False) -> None:
        """The state `step` begins from; with `grads`, the gradients it begins with too."""
        model, optimizer = model_and_optimizer(objects)
        self.step = step
        copies = _Copies()
        self.grads = _carried_grads(objects.params, self.grad_buffers, copies) if grads else None
        # NB: keep_vars: the parameters themselves, not a detached view of each (a kernel
        # call per tensor); the copies run outside autograd. FSDP: this rank's shards
        held = model.state_dict(keep_vars=True)
        copies.into(self.model, sharded.local_state(held))
        modules, optimizers = _others(objects, model, optimizer)
        states = [m.state_dict(keep_vars=True) for m in modules]
        owned = {id(t) for state in [held, *states] for t in state.values()}
        copies.into(self.unowned, _unowned(optimizer, owned))
        self.optimizer = _optimizer_copy(optimizer, self.optimizer, copies)
        kept = {id(o.owner): o for o in self.others}
        self.others = [
            _Other.of_module(m, state, kept.get(id(m)), copies)
            for m, state in zip(modules, states, strict=True)
        ] + [_Other.of_optimizer(o, owned, kept.get(id(o)), copies) for o in optimizers]
        copies.run()
        self.scaler = amp.capture(objects.scaler)
        scheduler = objects.scheduler
        self.scheduler = copy.deepcopy(scheduler.state_dict()) if scheduler else None
        self.rng = RngState.capture()

    def restore(self, objects: TrainingObjects) -> None:
        model, optimizer = model_and_optimizer(objects)
        device = objects.device
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)  # the async copies into host memory are done
        model.load_state_dict(sharded.model_state_like(model, self.model))
        modules = [o.owner for o in self.others if isinstance(o.owner, nn.Module)]
        owned = {id(t) for m in [model, *modules] for t in m.state_dict(keep_vars=True).values()}
        _restore_optimizer(optimizer, self.optimizer, self.unowned, owned)
        for other in self.others:  # NB: those met since the capture stay as they are
            if isinstance(other.owner, nn.Module):
                other.owner.load_state_dict(sharded.model_state_like(other.owner, other.state))
            else:
                _restore_optimizer(other.owner, other.state, other.unowned, owned)
        _restore_grads(objects.params, self.grads, self.grad_buffers)
        amp.restore(objects.scaler, self.scaler)
        if objects.scheduler is not None and self.scheduler is not None:
            objects.scheduler.load_state_dict(copy.deepcopy(self.scheduler))
        if self.rng is not None:
            self.rng.restore()


@dataclass
class _Other:
    """Another root module's state, or another optimizer's (with its parameters no module
    holds, by place), kept with the object itself: one the loop met after the capture is
    not in the snapshot, and a restore leaves it as it is."""

    owner: nn.Module | torch.optim.Optimizer
    state: dict[str, Any]
    unowned: dict[int, Tensor] = field(default_factory=dict)

    @classmethod
    def of_module(
        cls, module: nn.Module, state: dict[str, Any], kept: _Other | None, copies: _Copies
    ) -> _Other:
        buffers = kept.state if kept is not None else {}
        return cls(module, copies.into(buffers, sharded.local_state(state)))

    @classmethod
    def of_optimizer(
        cls, optimizer: torch.optim.Optimizer, owned: set[int], kept: _Other | None, copies: _Copies
    ) -> _Other:
        unowned = copies.into(kept.unowned if kept else {}, _unowned(optimizer, owned))
        return cls(
            optimizer, _optimizer_copy(optimizer, kept.state if kept else {}, copies), unowned
        )


def _carried_grads(
    params: list[nn.Parameter], buffers: dict[str, Tensor], copies: _Copies
) -> list[tuple[nn.Parameter, str]]:
    """Plan the copy of the parameters' gradients into `buffers`, by place (NB: plain
    tensors only: a sharded gradient is FSDP's to manage)."""
    held = {str(i): p.grad for i, p in enumerate(params) if type(p.grad) is torch.Tensor}
    copies.into(buffers, held)
    return [(params[int(i)], i) for i in held]


def _restore_grads(
    params: list[nn.Parameter],
    kept: list[tuple[nn.Parameter, str]] | None,
    buffers: dict[str, Tensor],
) -> None:
    """The gradients as the step began: those kept, else none. NB: a loop zeroes its
    gradients before the backward (or after the step), so none is what its steps began
    with; gradients the restore found are a later step's, which a replay must not add to
    (the drivers that keep the caller's put them back afterwards: `Gradients`)."""
    held = {id(p): buffers[key] for p, key in kept or ()}
    with torch.no_grad():
        for p in params:
            kept_grad = held.get(id(p))
            p.grad = kept_grad.to(p.device, copy=True) if kept_grad is not None else None


def _others(
    objects: TrainingObjects, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The root modules and optimizers besides `model` and `optimizer`; one optimizer per
    set of parameters (a wrapper such as accelerate's and the one inside it step the same)."""
    modules = [m for m in objects.others if m is not model]
    seen = [stepped_ids(optimizer)]
    optimizers = []
    for o in objects.optimizers:
        ids = stepped_ids(o)
        if ids not in seen:
            seen.append(ids)
            optimizers.append(o)
    return modules, optimizers


def _optimizer_copy(
    optimizer: torch.optim.Optimizer, kept: dict[str, Any], copies: _Copies
) -> dict[str, Any]:
    """The optimizer's state, planned into `kept`'s host buffers (`_Copies`)."""
    state = sharded.local_optimizer_state(optimizer.state_dict())
    buffers = kept.get("state", {})
    return {
        "state": {i: copies.into(buffers.get(i, {}), s) for i, s in state["state"].items()},
        "param_groups": copy.deepcopy(state["param_groups"]),
    }


def _restore_optimizer(
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    unowned: dict[int, Tensor],
    owned: set[int],
) -> None:
    with torch.no_grad():
        for i, param in _unowned(optimizer, owned).items():
            kept = unowned.get(i)  # NB: none for a parameter added since
            if kept is not None and kept.shape == param.shape:
                param.copy_(kept)
    # NB: load_state_dict keeps tensors that already sit on the right device and dtype,
    # and the optimizer then updates them in place: hand it copies, keep ours intact.
    optimizer.load_state_dict(sharded.optimizer_state_like(optimizer, _cloned(state)))


def _unowned(optimizer: torch.optim.Optimizer, owned: set[int]) -> dict[int, Tensor]:
    """The optimizer's plain (unsharded) parameters that no module's state holds (`owned`:
    their ids), by their place among its parameters: the snapshot keeps their values too."""
    params = (p for group in optimizer.param_groups for p in group["params"])
    return {i: p for i, p in enumerate(params) if id(p) not in owned and local(p) is p}


class _Copies:
    """The tensors a snapshot copies into its host buffers, copied together: one fused
    copy per device and dtype rather than a kernel call per tensor (NB: on a step of a few
    milliseconds, the calls of a model's 40 copies cost as much as the bytes). Buffers
    still missing are made together too, one block per dtype (`_host_block`)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]]
        self._groups = {}
        self._missing: dict[tuple[torch.dtype, bool], list[tuple[dict, Any, Tensor]]] = {}

    def into(self, buffers: dict, source: dict) -> dict:
        """Plan the copy of `source`'s tensors into same-named host buffers (made in `run`
        where missing or unlike); its other values are copied now."""
        for key, value in source.items():
            if not isinstance(value, torch.Tensor):
                buffers[key] = copy.deepcopy(value)
                continue
            buf = buffers.get(key)
            if not (
                isinstance(buf, torch.Tensor)
                and buf.shape == value.shape
                and buf.dtype == value.dtype
            ):
                pin = value.device.type == "cuda"
                self._missing.setdefault((value.dtype, pin), []).append((buffers, key, value))
                continue
            self._plan(buf, value)
        return buffers

    def _plan(self, buf: Tensor, value: Tensor) -> None:
        targets, sources = self._groups.setdefault((value.device, value.dtype), ([], []))
        targets.append(buf)
        sources.append(value)

    def run(self) -> None:
        for (dtype, pin), missing in self._missing.items():
            sizes = [value.numel() for _, _, value in missing]
            block = _host_block(sum(sizes), dtype, pin)
            for (buffers, key, value), part in zip(missing, block.split(sizes), strict=True):
                buffers[key] = buf = part.view(value.shape)
                self._plan(buf, value)
        self._missing = {}
        with torch.no_grad():
            for targets, sources in self._groups.values():
                torch._foreach_copy_(targets, sources, non_blocking=True)


def _host_block(count: int, dtype: torch.dtype, pin: bool) -> Tensor:
    """Host memory for `count` elements, mapped on its own, outside malloc's heap (pinned,
    for copies from CUDA, where torch's allocator makes it). NB: buffers kept for the run
    and made in the heap lie among the step's own allocations, which then no longer fit
    where they did: a float32 MLP's snapshots (74 MiB) raised its peak by 65 to 91 MiB in
    the heap, by 67 to 72 in blocks of their own (fresh processes, two hash seeds)."""
    if pin or count == 0:
        return torch.empty(count, dtype=dtype, pin_memory=pin)
    try:
        mapped = mmap.mmap(-1, count * dtype.itemsize)
    except OSError as e:  # NB: ENOMEM: the store gives up as on any memory error
        raise MemoryError(str(e)) from e
    return torch.frombuffer(mapped, dtype=dtype, count=count)


def _cloned(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cloned(v) for v in obj]
    return copy.deepcopy(obj)


class SnapshotStore:
    """The snapshots and batches that let any recent step be replayed."""

    def __init__(
        self,
        objects: TrainingObjects,
        every: int | None = None,
        *,
        agree: Callable[[int], int] | None = None,
        position: Callable[[int], Any] | None = None,
    ) -> None:
        self.objects = objects
        self.every = every  # None: decided from the state's size (`auto`)
        # NB: in a data-parallel job, each rank's `auto` period from its own shards and
        # batches, made the job's (the largest): ranks that snapshot at different steps
        # would rewind a replay to different steps, and its collectives would hang
        self.agree = agree
        self.position = position  # where the data stood at a step (`BatchStream.position`)
        self._snapshots: list[StateSnapshot] = []
        self._spare: list[StateSnapshot] = []
        self._pinned: StateSnapshot | None = None
        self._batches: dict[int, Any] = {}
        self._drawn: dict[int, torch.Tensor] = {}  # torch's RNG once each batch was drawn
        self._spare_batches: list[Any] = []  # copies no longer kept: buffers to reuse
        self.out_of_memory = False  # snapshots stopped: no memory left to keep them

    def before_step(
        self, step: int, batch: Any, *, copied: bool = False, grads: bool = False
    ) -> None:
        """Keep `batch` (a private host copy of it, unless it is `copied` already: a
        Guard's `KeptStep`, made with `spare_batch()`'s buffers) and, by the policy, the
        state the step starts from (with `grads`: the gradients carry into the step)."""
        if self.out_of_memory:
            return
        try:
            self._batches[step] = batch if copied else self._copy(batch)
            self._drawn[step] = torch.get_rng_state()
            if not self._snapshots or step - self._snapshots[-1].step >= self._every():
                self._capture(step, grads)
                self._snapshots[-1].data = self._position(step)
                self._forget_old_batches()  # NB: only a capture (or unpin) makes batches old
        except Exception as e:  # NB: not only OutOfMemoryError: the CPU's is a RuntimeError
            if not out_of_memory(e):
                raise
            self._give_up()

    def _copy(self, batch: Any) -> Any:
        """A private host copy of `batch`, in the buffers of a batch no longer kept where
        laid out alike (`tensors.HostBuffers`)."""
        return host_copy(batch, reuse=self.spare_batch())

    def spare_batch(self) -> Any | None:
        """A kept batch no kept snapshot reaches any more, whose buffers the caller may
        overwrite (None if there is none): the store's own copy, or a `KeptStep`."""
        return self._spare_batches.pop() if self._spare_batches else None

    def _give_up(self) -> None:
        """Out of host memory for snapshots: keep none, free their buffers, and let the
        run go on unwatched by replays (a replay then says it cannot rewind)."""
        self.out_of_memory = True
        self._snapshots, self._spare, self._pinned, self._batches = [], [], None, {}
        self._drawn = {}
        self._spare_batches = []

    def pin(self, step: int) -> None:
        """Keep the snapshot that reaches `step` until `unpin` (a scaler streak began)."""
        self._pinned = self._latest_at_or_before(step)

    def unpin(self) -> None:
        self._pinned = None
        self._forget_old_batches()

    def rewind_to(self, step: int, *, earliest: bool = False) -> list[tuple[int, Any]]:
        """Restore the latest snapshot at or before `step` (with `earliest`, the oldest one
        that reaches it); return the batches from it up to `step` inclusive: replay them in
        order and the last one is `step` itself."""
        snapshot = self._earliest_reaching(step) if earliest else self._latest_at_or_before(step)
        if snapshot is None or any(s not in self._batches for s in range(snapshot.step, step + 1)):
            raise LookupError(f"no snapshot reaches step {step}")
        snapshot.restore(self.objects)
        return [(s, self._batches[s]) for s in range(snapshot.step, step + 1)]

    def rewind_for_replay(self, step: int, *, earliest: bool = False) -> list[tuple[int, Any]]:
        """Rewind to the newest snapshot that reaches the step before `step` (with
        `earliest`, as far back as the kept snapshots reach), so that at least the step
        before is replayed too and its update measured; never past `start_step`."""
        if step > self.objects.start_step:
            try:
                return [*self.rewind_to(step - 1, earliest=earliest), self.batch_at(step)]
            except LookupError:
                pass
        return self.rewind_to(step)

    def reaches_further_back(self, first: int, step: int) -> bool:
        """Whether a kept snapshot older than step `first` also reaches `step`."""
        oldest = self._earliest_reaching(step)
        return oldest is not None and oldest.step < first

    def resume_point(self, step: int) -> StateSnapshot | None:
        """The newest kept state at or before `step`: where a run can resume from to reach
        it (what-if replays of a fix start there rather than at step 0)."""
        return self._latest_at_or_before(step)

    def drawn(self, step: int) -> None:
        """Put torch's RNG back as it stood once `step`'s batch was drawn, before a replay
        runs the step. NB: between two steps the run drew the next batch, and drawing it
        may draw from the RNG the step's dropout draws from (a DataLoader draws its
        shuffle and its workers' seed as an epoch begins); a replay from kept batches
        draws none of that again. (Python's and numpy's RNG, which a step itself seldom
        draws from, stay as the snapshot put them: reading theirs costs ~40 us a step.)"""
        state = self._drawn.get(step)
        if state is not None:
            torch.set_rng_state(state)

    def _position(self, step: int) -> Any:
        """Where the data stood at `step`, with its kept batch (None: not known)."""
        where = self.position(step) if self.position is not None else None
        return dataclasses.replace(where, batch=self._batches[step]) if where is not None else None

    def batch_at(self, step: int) -> tuple[int, Any]:
        if step not in self._batches:
            raise LookupError(f"the batch of step {step} is no longer kept")
        return step, self._batches[step]

    def capture_now(self, step: int) -> StateSnapshot:
        snapshot = StateSnapshot()
        snapshot.capture(self.objects, step)
        return snapshot

    @property
    def nbytes(self) -> int:
        """Bytes the store holds: its snapshots' buffers (kept, pinned, or spare, waiting
        to be reused) and its batches'."""
        held = [*self._snapshots, self._pinned, *self._spare]
        kept = {id(s): s for s in held if s is not None}
        return sum(s.nbytes for s in kept.values()) + self.batch_nbytes

    @property
    def batch_nbytes(self) -> int:
        """Bytes of the batches kept, and of the copies waiting to be reused."""
        return tensor_bytes([*self._batches.values(), *self._spare_batches])

    def _every(self) -> int:
        if self.every is None:
            _, optimizer = model_and_optimizer(self.objects)
            # NB: no state yet (Adam & co. create theirs at their first update, which a
            # GradScaler may skip) or none ever (SGD without momentum): the shortest
            # period, asked again at each step until the state is there to size it (a
            # capture every step until then made a stateless run capture every step)
            if not optimizer.state:
                return AUTO_MIN_EVERY
            size = state_bytes(self.objects)
            period = math.ceil(size / AUTO_BYTES_PER_STEP)
            batch = max((tensor_bytes(b) for b in self._batches.values()), default=0)
            if batch:  # NB: two periods of batches are kept
                period = min(period, max(size, AUTO_BATCH_BUDGET) // (2 * batch))
            period = max(AUTO_MIN_EVERY, min(AUTO_MAX_EVERY, period))
            self.every = self.agree(period) if self.agree is not None else period
        return self.every

    def _capture(self, step: int, grads: bool = False) -> None:
        # NB: with two kept, the older is the one this capture drops: its buffers take the
        # copy (a spare beside the two kept would hold a third copy of the state)
        if len(self._snapshots) >= 2 and self._snapshots[0] is not self._pinned:
            reuse = self._snapshots.pop(0)
        else:
            reuse = self._spare.pop() if self._spare else StateSnapshot()
        reuse.capture(self.objects, step, grads)
        self._snapshots.append(reuse)
        while len(self._snapshots) > 2:
            old = self._snapshots.pop(0)
            if old is not self._pinned:
                self._spare.append(old)

    def _latest_at_or_before(self, step: int) -> StateSnapshot | None:
        candidates = [
            s for s in [*self._snapshots, self._pinned] if s is not None and s.step <= step
        ]
        return max(candidates, key=lambda s: s.step, default=None)

    def _earliest_reaching(self, step: int) -> StateSnapshot | None:
        kept = [s for s in [*self._snapshots, self._pinned] if s is not None and s.step <= step]
        reaching = [s for s in kept if all(i in self._batches for i in range(s.step, step + 1))]
        return min(reaching, key=lambda s: s.step, default=None)

    def _forget_old_batches(self) -> None:
        """Drop the batches no kept snapshot reaches: they are the next steps' buffers
        (NB: replacing the spares of the last time, left over because the batches
        changed layout: the spares never outnumber the batches the store kept before)."""
        kept = [s.step for s in [*self._snapshots, self._pinned] if s is not None]
        oldest = min(kept, default=0)
        old = [s for s in self._batches if s < oldest]
        if old:
            self._spare_batches = [self._batches.pop(s) for s in old]
            for s in old:
                self._drawn.pop(s, None)


def state_bytes(objects: TrainingObjects) -> int:
    """Bytes of weights, buffers and optimizer state: what one snapshot copies."""
    model, optimizer = model_and_optimizer(objects)
    modules, optimizers = _others(objects, model, optimizer)
    tensors = [t for m in [model, *modules] for t in m.state_dict().values()]
    tensors += iter_tensors([list(o.state.values()) for o in [optimizer, *optimizers]])
    return sum(local(t).numel() * t.element_size() for t in tensors)  # FSDP: this rank's shard
