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

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from nandoctor.errors import UserCodeError, out_of_memory
from nandoctor.localize.reproduction import StepLoss
from nandoctor.localize.samples import find_samples, in_a_job
from nandoctor.localize.tracer import Sighting, Tracer
from nandoctor.localize.update import UpdateTracker
from nandoctor.report.evidence import ModuleStat, UpdateRatio
from nandoctor.report.types import Transient
from nandoctor.runtime import amp
from nandoctor.runtime.probe import Phase, Probes
from nandoctor.runtime.recheck import Gradients
from nandoctor.runtime.rerun import StepRunner
from nandoctor.runtime.snapshot import SnapshotStore, StateSnapshot
from nandoctor.runtime.state import TrainingObjects, device_of
from nandoctor.runtime.verdict import Verdict

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
    finding: Sighting | None  # None: the replay saw nothing non-finite (not reproduced)
    modules: list[ModuleStat] = field(default_factory=list)
    from_step: int | None = None
    seconds: float = 0.0
    note: str | None = None
    transients: list[Transient] = field(default_factory=list)  # healed on the way
    reached: bool = True  # False: the replay ended before the step (a rerun of a command)
    drift: str | None = None  # a replayed step's loss differed from the run's (`Recorded`)
    # the stage of the replay that ran out of memory, even with the lighter trace: `saving
    # the run's state to replay from`, `rerunning steps 3 to 6 on the way`, `in the full
    # trace of step 7 and again in the lighter one`
    out_of_memory: str | None = None
    # the loss of each step the replay ran (the kept steps, then this one), as the run's
    # telemetry records it: what `reproduction` holds against the run's
    losses: dict[int, float] = field(default_factory=dict)
    # the replay itself failed (out of memory, nothing to rewind to, the user's code
    # raised): it says nothing of whether the failure reproduces
    failed: bool = False

    @property
    def found(self) -> bool:
        return self.finding is not None


Replayer = Callable[[int, float | None], Localization]  # (step, loss scale) -> what it found
Recorded = Mapping[int, float]  # the run's loss at each step, to check the replay against


def localize_failure(
    failure: Verdict, start_step: int, replay: Replayer
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
            return earlier, failure.blamed_on_update(why)
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
    it replays once more with a lighter one; out of memory again, it says in which stage
    (`Localization.out_of_memory`).
    """
    started = time.perf_counter()
    try:
        with _stage("saving the run's state to replay from"):
            here = store.capture_now(-1)
            grads = Gradients.keep(objects)  # NB: a snapshot has none; the loop left some
    except _RanOut as e:
        return Localization(step, None, out_of_memory=e.stage, reached=False, failed=True)
    try:
        located = _full_or_light(objects, store, step, steps, started, loss_scale, here, recorded)
    except LookupError as e:
        located = Localization(step, None, note=f"could not rewind: {e}", failed=True)
    except _RanOut as e:
        located = Localization(step, None, out_of_memory=e.stage, reached=False, failed=True)
    except UserCodeError as e:
        failed = f"the replay of step {step} failed: {e.message}"
        located = Localization(step, None, note=failed, failed=True)
    try:
        with _stage("restoring the run's state after the replay"):
            here.restore(objects)
            grads.restore()
    except _RanOut:
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
    except _RanOut as e:
        full = e.stage
    with _stage(f"rewinding to step {step}"):
        here.restore(objects)
    _free_memory(objects)
    try:
        located = _replay(objects, store, step, steps, started, loss_scale, recorded, light=True)
    except _RanOut as e:
        both = e.stage == full.replace("full", "lighter", 1)  # NB: the trace, each time
        raise _RanOut(f"{full} and again in the lighter one" if both else e.stage) from e
    located.note = LIGHTER_NOTE
    return located


class _RanOut(Exception):
    """Out of memory in a stage of the replay (what the stage was doing, in words)."""

    def __init__(self, stage: str) -> None:
        super().__init__(stage)
        self.stage = stage


@contextlib.contextmanager
def _stage(stage: str) -> Iterator[None]:
    """Out of memory inside: `_RanOut(stage)`, raised by the tracer or inside the user's
    code (which wraps it: a `UserCodeError`), on the GPU or the CPU (whose allocator
    raises a plain RuntimeError)."""
    try:
        yield
    except Exception as e:
        if not out_of_memory(e.error if isinstance(e, UserCodeError) else e):
            raise
        raise _RanOut(stage) from e


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
    with _stage(f"rewinding to step {step}"):
        kept = store.rewind_for_replay(step)
    updates, losses = _rerun(objects, store, steps, kept[:-1])
    if updates.latest is None and store.reaches_further_back(kept[0][0], step - 1):
        # NB: no step since the newest snapshot moved the weights (a streak of scaler
        # skips): the last update that did lies further back
        with _stage(f"rewinding to step {step}"):
            kept = store.rewind_for_replay(step, earliest=True)
        updates, losses = _rerun(objects, store, steps, kept[:-1])
    note = set_loss_scale(objects, loss_scale)
    with _stage(f"in the {'lighter' if light else 'full'} trace of step {step}"):
        tracer = Tracer(objects, light=light)
        loss = StepLoss(tracer.quiet)
        store.drawn(step)
        before = None if light or in_a_job() else _state_before(store, step)
        with tracer:
            steps.run(step, kept[-1][1], Probes(tracer, loss))
        located = localization_of(tracer, step, kept[0][0], updates.latest, started, note)
    located.drift = _drift(losses, recorded)
    located.losses = losses if loss.value is None else {**losses, step: loss.value}
    if located.finding is not None:
        located.finding = find_samples(objects, steps, step, kept[-1][1], located.finding, before)
    return located


def _state_before(store: SnapshotStore, step: int) -> StateSnapshot | None:
    """The state the traced step begins with, for the reruns that find its samples (None
    where host memory cannot hold one more copy: the samples then stay unknown)."""
    try:
        return store.capture_now(step)
    except Exception as e:  # NB: not only OutOfMemoryError: the CPU's is a RuntimeError
        if not out_of_memory(e):
            raise
        return None


def _rerun(
    objects: TrainingObjects,
    store: SnapshotStore,
    steps: StepRunner,
    kept: list[tuple[int, object]],
) -> tuple[UpdateTracker, dict[int, float]]:
    """Re-run the steps from a snapshot up to the bad one, measuring their updates and
    recording their losses."""
    updates, losses = UpdateTracker(objects), {}
    for s, batch in kept:
        loss = StepLoss()
        with _stage(f"rerunning steps {kept[0][0]} to {kept[-1][0]} on the way"):
            updates.before()
            store.drawn(s)
            steps.run(s, batch, loss)
            updates.after(s)
        if loss.value is not None:
            losses[s] = loss.value
    return updates, losses


def _drift(losses: dict[int, float], recorded: Recorded | None) -> str | None:
    """Words for the first rerun step whose loss left the run's, or None."""
    for step, replayed in losses.items():
        run = recorded.get(step) if recorded is not None else None
        if run is not None and (words := _drifted(step, run, replayed)) is not None:
            return words
    return None


def _drifted(step: int, recorded: float, replayed: float) -> str | None:
    """Words for a replayed loss off the run's (beyond 1e-3 of it: a nondeterministic
    kernel's last digits are not a drift), or None."""
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
    "Localization",
    "Replayer",
    "localization_of",
    "localize",
    "localize_failure",
    "set_loss_scale",
]
