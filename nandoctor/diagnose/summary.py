"""The report's sentences for people, written here once for every driver and renderer: the
one-line summary and the notes about how the run and its replay went.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nandoctor.causes.words import plural, value_word, values
from nandoctor.localize.finding import batch_finding
from nandoctor.localize.replay import Localization
from nandoctor.localize.reproduction import VALUES_DIFFER, Reproduction
from nandoctor.localize.tracer import Sighting
from nandoctor.report.divergence import diverged_clause
from nandoctor.report.telemetry import Event
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.record import RunResult, RunStatus
from nandoctor.runtime.verdict import Verdict
from nandoctor.setup.devices import cpu_autocast_note
from nandoctor.setup.session import Session
from nandoctor.setup.torch_globals import changed_torch_globals

REPLAY_INTERRUPTED = "interrupted during the instrumented replay: where and why are unknown"
VERIFY_INTERRUPTED = "interrupted while verifying fixes; the causes are not verified"
NOT_VERIFIED_ON_RANKS = (
    "fixes are not replayed in a distributed run; rerun on one process to verify"
)


def summarize(
    status: str,
    result: RunResult,
    located: Localization | None = None,
    command_code: int | None = None,
    events: Sequence[Event] = (),
) -> str:
    """One sentence: what happened. `status` is the report's (an interrupt may have ended
    the run); the sentence of a failure names the replay's phase, the precise one.
    `command_code`: a watched command's exit code; `events`: the report's, whose
    divergences a run that stayed finite owes its reader ("..., but the loss diverged at
    step 1": finite is not training well)."""
    said = _sentence(status, result, located, command_code)
    diverged = diverged_clause(events) if result.failure is None else None
    return said if diverged is None else f"{said}, but {diverged}"


def _sentence(
    status: str, result: RunResult, located: Localization | None, command_code: int | None
) -> str:
    stopped = status == "interrupted" and result.failure is None
    if result.status is RunStatus.INTERRUPTED or stopped:
        ran = plural(result.steps_run, "step")
        return f"interrupted after {ran}; no non-finite value seen before"
    if result.status is RunStatus.TIMEOUT:
        ran = plural(result.steps_run, "step")
        return f"the time budget stopped the run after {ran}, all finite"
    if result.ended_by is not None:  # sys.exit() in the user's code, before any NaN
        return f"{result.ended_by}, after {plural(result.steps_run, 'finite step')}"
    if result.failure is None and command_code is not None:
        # NB: not "all 0 steps stayed finite" (the notes say why, but `-q` shows no notes)
        if status == "error" and not result.steps_run:
            return f"the command exited with code {command_code} before any step was seen"
        if status == "error":
            ran = plural(result.steps_run, "finite step")
            return f"the command exited with code {command_code} after {ran}"
        if not result.steps_run:
            return "no training step was seen, so nothing was checked"
    if result.failure is None:
        if result.steps_run == 1:
            return "the run's one step stayed finite"
        return f"all {result.steps_run} steps stayed finite"
    f = result.failure
    found = located.finding if located is not None else None
    found = found or batch_finding(f)  # NB: no replay: the batch the sentinel kept
    phase = found.phase if found is not None else f.phase
    micro = found.micro_batch if found is not None else None
    where = f"step {f.step}" + (f", micro-batch {micro}" if micro is not None else "")
    head = f"{where}, phase {phase.value if phase else '?'}" + _ranks_clause(f)
    if found is None:
        return f"{head}: {f.why}"
    if found.op is None:
        return f"{head}: {found.tensor} held {values(found.count, found.value)}"
    sentence = _origin_sentence(found)
    scaler = f.collapsed or f.hidden  # the verdict's words say what the scaler did
    return f"{head}: {f.why}; {sentence}" if scaler else f"{head}: {sentence}"


def run_notes(session: Session, result: RunResult, steps: int) -> list[str]:
    """What the reader should know about how `diagnose` ran the session."""
    notes = list(session.notes)  # what building it noticed (numeric strings read as numbers)
    if session.config.device == "auto" and session.device.type == "cpu":
        notes.append("device auto: no CUDA device found, so the run replayed on the CPU")
    native = session.autocast_policy == "native"
    if native and session.device.type == "cpu" and session.dtype != torch.float32:
        notes.append(cpu_autocast_note(str(session.dtype).removeprefix("torch.")))
    if result.status is RunStatus.TIMEOUT:
        notes.append(
            f"time budget: stopped after {result.steps_run} of {plural(steps, 'step')}; "
            "the steps run are judged, the rest are not"
        )
    notes.extend(globals_notes())
    notes.extend(long_replay_note(result, session.config.checkpoint))
    return notes


LONG_REPLAY = 10_000  # steps replayed from step 0 past which the report suggests a checkpoint


def long_replay_note(result: RunResult, checkpoint: str | None) -> list[str]:
    """A run replayed from step 0 for more than `LONG_REPLAY` steps took as long as the
    job did to get there; resumed from the job's last checkpoint before the failure, the
    next diagnosis starts a few steps from it (docs/index.md's first recipe)."""
    if checkpoint is not None or result.steps_run <= LONG_REPLAY:
        return []
    return [
        f"replayed {result.steps_run:,} steps from step 0 to get here: for a job that fails "
        "after hours, point `checkpoint:` in the config at its last checkpoint before the "
        "failure (with the `step` it was saved at) and the replay starts there (docs/index.md)"
    ]


def globals_notes() -> list[str]:
    """The global torch settings the user's code changed (`setup.torch_globals`)."""
    return [
        f"your code set torch's {name} to {value}: your calls ran with it, nandoctor's own "
        "checks and replays with the value it started with"
        for name, value in changed_torch_globals().items()
    ]


DEAD_STEPS = 10  # a gradient norm of exactly 0 this many steps in a row, to the end


def dead_gradients_note(result: RunResult) -> list[str]:
    """A run whose gradients were exactly 0 for its last steps learns nothing any more,
    however finite: a network that blew up and saturated (dead ReLUs, a softmax at its
    extremes), or a loss that no longer depends on the weights. Said, not failed: finite
    is healthy (SPEC), but the reader should not take it for a run that trains."""
    steps, norms = result.telemetry.step, result.telemetry.grad_norm
    tail = 0
    for norm in reversed(norms):
        if norm != 0.0:
            break
        tail += 1
    if tail < DEAD_STEPS:
        return []
    since = steps[len(steps) - tail]
    every = "at every step" if tail == len(steps) else f"from step {since} on"
    return [
        f"the gradient norm was exactly 0 {every} ({plural(tail, 'step')}): nothing has "
        "learned since (dead units after a blow-up, a saturated softmax, or a loss that no "
        "longer depends on the weights)"
    ]


def replay_notes(
    located: Localization | None,
    failure: Verdict | None = None,
    replayed: Reproduction | None = None,
) -> list[str]:
    """What the replay of the bad step has to say about itself, if anything (first,
    that it left the run's path on the way, when it did; then, when it went non-finite
    with other values than the run's, that it did)."""
    if located is None:
        return []
    drift = [located.drift] if located.drift else []
    if replayed is not None and replayed.step is not None and not drift:
        drift = [_values_differ(located.step, replayed)]
    return drift + _replay_notes(located, failure)


def _values_differ(step: int, replayed: Reproduction) -> str:
    """The replay's numbers are not the run's: it went non-finite all the same, or it did
    not, having left the run's path on the way."""
    losses = (
        f"step {replayed.step}'s loss was {replayed.run!r} in the run, {replayed.replay!r} "
        f"in the replay"
    )
    why = (
        "nondeterministic kernels (a GPU's atomic adds; torch.use_deterministic_algorithms"
        "(True) rules them out), noise drawn from outside the seeded generators, or state "
        "the replay does not rewind"
    )
    if replayed.word == VALUES_DIFFER:
        return (
            f"the instrumented replay of step {step} went non-finite as the run did, with "
            f"other values: {losses} (reproduced: values-differ): {why}; the origin named "
            "is where this replay went non-finite"
        )
    return (
        f"the instrumented replay did not follow the run exactly on its way to step {step}: "
        f"{losses}: {why}"
    )


def _replay_notes(located: Localization, failure: Verdict | None) -> list[str]:
    if located.out_of_memory is not None:
        return [replay_out_of_memory(located)]
    if located.found:
        return [located.note] if located.note else []
    if not located.reached:  # NB: it saw nothing because it never got there
        return [f"the instrumented replay did not reach step {located.step}: {located.note}"]
    note = f" ({located.note})" if located.note else ""
    if failure is not None and failure.phase is Phase.PARAMETERS:
        return [
            f"the instrumented replay of step {located.step} began it with finite weights: "
            f"the weights were non-finite when step {located.step} began, yet the steps "
            "replayed before it left them finite: something outside the steps changed them (a "
            "checkpoint loaded or weights edited between steps), or the run is "
            f"nondeterministic{note}"
        ]
    seen = " reach the loss, a gradient or a weight" if located.transients else ""
    why = (
        "the failure did not reproduce (reproduced: not-reproduced), so it is "
        "nondeterministic or transient: a race, a fault of the hardware, or state the "
        "replay does not rewind (see transient-fault)"
    )
    if located.failed:  # NB: the replay itself went wrong: it says nothing of the failure
        return [f"the instrumented replay of step {located.step} could not run: {located.note}"]
    return [
        f"the instrumented replay of step {located.step} saw no non-finite value{seen}: {why}{note}"
    ]


def replay_out_of_memory(located: Localization) -> str:
    """`the instrumented replay of step 7 ran out of memory in the full trace of step 7
    and again in the lighter one: what the run saw stands ...`."""
    return (
        f"the instrumented replay of step {located.step} ran out of memory "
        f"{located.out_of_memory}: what the run saw stands (the step and its phase); the "
        "operator, module and line the replay would have named are unknown"
    )


def _origin_sentence(found: Sighting) -> str:
    parts = [str(found.op)]
    if found.evidence.backward_of:
        parts.append(f"in the backward of {found.evidence.backward_of}")
    if found.module is not None:
        parts.append(f"in {found.module or '(root)'}")
    if found.source:
        parts.append(f"at {found.source}")
    value = value_word(found.value, found.evidence.output)
    what = f"{value} in its {found.tensor} ({found.count} of {found.dtype} {found.shape})"
    return " ".join(parts) + f" produced {what}"


def _ranks_clause(failure: Verdict) -> str:
    origin, inherited = failure.reading.origin_ranks, failure.reading.inherited_ranks
    if not origin:
        return ""
    clause = f", born on rank {', '.join(map(str, origin))}"
    if inherited:
        clause += (
            f" (rank {', '.join(map(str, inherited))} inherited it as the gradients were combined)"
        )
    return clause
