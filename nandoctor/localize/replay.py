"""The one localisation: rewind to the bad step and replay it under the tracer, to name
the op, module, tensor and source line.

`localize` starts from the earliest kept snapshot that reaches the bad step, re-runs the
steps in between plainly (measuring their updates), then runs the bad step with the
tracer. Afterwards the training objects are put back exactly as they were (weights,
optimizer, scaler, RNG): localisation leaves no trace. How a step is run again is the
driver's (`runtime.rerun`: nandoctor's `run_step`, or the user's step a `Guard` kept).

`localize_failure` holds what every driver does with a failure, `watch`'s rerun of a
whole script included: replay a collapse at the scale the streak fell to, a failure the
GradScaler hid at loss scale 1, and when the replay meets weights that were already
broken, trace the step before, whose update broke them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch

from nandoctor.errors import UserCodeError, out_of_memory
from nandoctor.localize.samples import find_samples, in_a_job
from nandoctor.localize.tracer import Finding, Tracer
from nandoctor.localize.update import UpdateTracker
from nandoctor.report.evidence import ModuleStat, UpdateRatio
from nandoctor.report.types import Transient
from nandoctor.runtime import amp
from nandoctor.runtime.probe import Phase, Probe, StepContext
from nandoctor.runtime.recheck import Gradients
from nandoctor.runtime.rerun import StepRunner
from nandoctor.runtime.sentinel import Verdict
from nandoctor.runtime.snapshot import SnapshotStore, StateSnapshot
from nandoctor.runtime.state import TrainingObjects, device_of
from nandoctor.runtime.tensors import MEMORY_ERRORS

NO_MEMORY_TO_REPLAY = (
    "no replay: out of memory saving the state to replay from; the report names the step "
    "and phase, not the tensor"
)
NO_MEMORY_TO_RESTORE = (
    "out of memory restoring the state after the replay: the causes below were judged on "
    "the replayed state"
)
LIGHTER_NOTE = (
    "out of memory in the full trace: replayed with a lighter one "
    "(no provenance, module magnitudes or float32 rerun)"
)


@dataclass
class Localization:
    step: int
    finding: Finding | None  # None: the replay saw nothing non-finite (not reproduced)
    modules: list[ModuleStat] = field(default_factory=list)
    from_step: int | None = None
    seconds: float = 0.0
    note: str | None = None
    transients: list[Transient] = field(default_factory=list)  # healed on the way
    reached: bool = True  # False: the replay ended before the step (a rerun of a command)
    drift: str | None = None  # a replayed step's loss differed from the run's (`Recorded`)

    @property
    def reproduced(self) -> bool:
        return self.finding is not None


Replay = Callable[[int, float | None], Localization]  # (step, loss scale) -> what it found
Recorded = Mapping[int, float]  # the run's loss at each step, to check the replay against


def localize_failure(
    failure: Verdict, start_step: int, replay: Replay
) -> tuple[Localization, Verdict]:
    """Replay the failure's step; return what it found and the failure, moved one step
    back when the replay met weights an update had broken at the step before.

    After a collapse of the GradScaler's scale the step is replayed at the scale the
    streak fell to, so that the benign overflow of a large scale does not hide the value
    that stays non-finite at any scale; a failure the scaler hid, at loss scale 1, where
    the tracer meets the math's own non-finite value, not an overflow of the scale
    (`Verdict.replay_scale`).
    """
    step = failure.step
    if step is None:
        raise ValueError("a verdict that did not fail has no step to replay")
    located = replay(step, failure.replay_scale)
    found = located.finding
    if (
        failure.phase is Phase.PARAMETERS
        and found is not None
        and found.phase is not Phase.PARAMETERS
    ):
        # NB: the replayed step began with finite weights: what it met later (a GradScaler
        # overflow, which the scaler skips) is another event than weights broken before it
        met = f"it met {found.op or found.tensor} in the {found.phase.value} phase instead"
        return replace(located, finding=None, note=met), failure
    # NB: past the first step, weights broken before the step were broken by an earlier
    # update (or changed between steps: the replay of the step before then finds nothing)
    if found is not None and found.phase is Phase.PARAMETERS and step > start_step:
        earlier = replay(step - 1, None)
        if earlier.finding is not None and earlier.finding.phase is Phase.OPTIMIZER:
            why = "the optimizer's update made parameters non-finite (the next step met them)"
            return earlier, replace(failure, step=step - 1, phase=Phase.OPTIMIZER, why=why)
    return located, failure


def localize(
    objects: TrainingObjects,
    store: SnapshotStore,
    step: int,
    steps: StepRunner,
    *,
    loss_scale: float | None = None,
    recorded: Recorded | None = None,
) -> Localization:
    """Replay `step` under the tracer, running kept steps with `steps`; leave no trace.

    `loss_scale` forces the replayed step's GradScaler scale (see `localize_failure`).
    `recorded`: the run's losses; a step rerun on the way whose loss differs says the
    replay left the run's path (`Localization.drift`). Out of memory in the full trace,
    it replays once more with a lighter one.
    """
    started = time.perf_counter()
    try:
        here = store.capture_now(-1)
        grads = Gradients.keep(objects)  # NB: a snapshot has none; the loop left some
    except MEMORY_ERRORS:
        return Localization(step, None, note=NO_MEMORY_TO_REPLAY)
    try:
        located = _full_or_light(objects, store, step, steps, started, loss_scale, here, recorded)
    except LookupError as e:
        located = Localization(step, None, note=f"could not rewind: {e}")
    except (*MEMORY_ERRORS, UserCodeError) as e:
        located = Localization(step, None, note=_failed(step, e))
    try:
        here.restore(objects)
        grads.restore()
    except MEMORY_ERRORS:
        _free_memory(objects)
        located.note = NO_MEMORY_TO_RESTORE
    return located


def _full_or_light(
    objects: TrainingObjects,
    store: SnapshotStore,
    step: int,
    steps: StepRunner,
    started: float,
    loss_scale: float | None,
    here: StateSnapshot,
    recorded: Recorded | None,
) -> Localization:
    """The full trace; out of memory, once more from where it started with a lighter one."""
    try:
        return _replay(objects, store, step, steps, started, loss_scale, recorded)
    except (*MEMORY_ERRORS, UserCodeError) as e:
        if not _out_of_memory(e):
            raise
    here.restore(objects)
    _free_memory(objects)
    located = _replay(objects, store, step, steps, started, loss_scale, recorded, light=True)
    located.note = LIGHTER_NOTE
    return located


def _out_of_memory(e: BaseException) -> bool:
    """Out of memory, raised by the tracer or inside the user's code (which wraps it)."""
    return out_of_memory(e.error if isinstance(e, UserCodeError) else e)


def _failed(step: int, e: BaseException) -> str:
    if _out_of_memory(e):
        return "out of memory even in the lighter trace"
    message = e.message if isinstance(e, UserCodeError) else str(e)
    return f"the replay of step {step} failed: {message}"


def _free_memory(objects: TrainingObjects) -> None:
    if device_of(objects).type == "cuda":
        torch.cuda.empty_cache()


def _replay(
    objects: TrainingObjects,
    store: SnapshotStore,
    step: int,
    steps: StepRunner,
    started: float,
    loss_scale: float | None,
    recorded: Recorded | None,
    light: bool = False,
) -> Localization:
    kept = store.rewind_for_replay(step)
    updates, drift = _rerun(objects, store, steps, kept[:-1], recorded)
    if updates.latest is None and store.reaches_further_back(kept[0][0], step - 1):
        # NB: no step since the newest snapshot moved the weights (a streak of scaler
        # skips): the last update that did lies further back
        kept = store.rewind_for_replay(step, earliest=True)
        updates, drift = _rerun(objects, store, steps, kept[:-1], recorded)
    note = set_loss_scale(objects, loss_scale)
    tracer = Tracer(objects, light=light)
    store.drawn(step)
    before = None if light or in_a_job() else _state_before(store, step)
    with tracer:
        steps.run(step, kept[-1][1], tracer)
    located = localization_of(tracer, step, kept[0][0], updates.latest, started, note)
    located.drift = drift
    if located.finding is not None:
        located.finding = find_samples(objects, steps, step, kept[-1][1], located.finding, before)
    return located


def _state_before(store: SnapshotStore, step: int) -> StateSnapshot | None:
    """The state the traced step begins with, for the reruns that find its samples (None
    where host memory cannot hold one more copy: the samples then stay unknown)."""
    try:
        return store.capture_now(step)
    except MEMORY_ERRORS:
        return None


def _rerun(
    objects: TrainingObjects,
    store: SnapshotStore,
    steps: StepRunner,
    kept: list[tuple[int, object]],
    recorded: Recorded | None,
) -> tuple[UpdateTracker, str | None]:
    """Re-run the steps from a snapshot up to the bad one, measuring their updates; and
    the first whose loss left the run's (`recorded`), in words."""
    updates, drift = UpdateTracker(objects), None
    for s, batch in kept:
        losses = _Losses() if recorded is not None and drift is None else None
        updates.before()
        store.drawn(s)
        steps.run(s, batch, losses)
        updates.after(s)
        if losses is not None and recorded is not None:
            drift = _drift(s, recorded.get(s), losses.value)
    return updates, drift


class _Losses(Probe):
    """A rerun step's loss, as the sentinel keeps it: the sum of the parts a followed
    loop backpropagates, the mean of nandoctor's own micro-batches'."""

    forward_phase = False

    def __init__(self) -> None:
        self.parts: list[float] = []
        self.value: float | None = None

    def phase_ended(self, ctx: StepContext, phase: Phase) -> None:
        if phase is Phase.LOSS and ctx.loss is not None:
            self.parts.append(float(ctx.loss.detach()))

    def step_ended(self, ctx: StepContext) -> None:
        if self.parts:
            self.value = ctx.step_loss(self.parts)


def _drift(step: int, recorded: float | None, replayed: float | None) -> str | None:
    """Words for a replayed loss off the run's (beyond 1e-3 of it: a nondeterministic
    kernel's last digits are not a drift), or None."""
    if recorded is None or replayed is None:
        return None
    finite = math.isfinite(recorded), math.isfinite(replayed)
    if finite == (False, False):
        return None
    if finite == (True, True) and abs(replayed - recorded) <= 1e-3 * max(1.0, abs(recorded)):
        return None
    return (
        f"the replay did not follow the run: step {step}'s loss was {recorded:.6g}, "
        f"replayed {replayed:.6g}: state the replay does not rewind changed between the "
        "steps (a module whose state the step reads, not given to the guard in modules=; "
        "a counter or cache in your code), or the run is nondeterministic; what the "
        "replay met may not be what the run met"
    )


def set_loss_scale(objects: TrainingObjects, loss_scale: float | None) -> str | None:
    """Force the next step's GradScaler scale; the note that says so in the report."""
    if loss_scale is None or objects.scaler is None:
        return None
    amp.set_scale(objects.scaler, loss_scale, device_of(objects))
    if loss_scale == 1.0:
        return "replayed at loss scale 1, unscaled: no overflow of the scale hides the origin"
    return f"replayed at loss scale {loss_scale:g}, where the streak of skips ended"


def localization_of(
    tracer: Tracer,
    step: int,
    from_step: int | None,
    update: UpdateRatio | None,
    started: float,
    note: str | None = None,
) -> Localization:
    """What the tracer found at `step`, with the update of the steps before it."""
    finding = tracer.finding
    if finding is not None:
        finding = replace(finding, evidence=replace(finding.evidence, update=update))
    seconds = time.perf_counter() - started
    modules = tracer.modules.stats(finding.root if finding is not None else 0)
    return Localization(
        step, finding, modules, from_step, seconds, note, transients=tracer.transients
    )


__all__ = [
    "MEMORY_ERRORS",
    "Localization",
    "Replay",
    "localization_of",
    "localize",
    "localize_failure",
    "set_loss_scale",
]
