"""What-if verification: apply a fix nandoctor can make itself, replay, see if it holds.

Which fixes apply to a cause is data in the cause's module (`FIXES` there, gathered in
`causes.index.FIXES`): a config change (`Change`: bfloat16, clipping, a 10x smaller
learning rate, a usable optimizer epsilon, skipping non-finite batches, zeroing the loaded
weights' non-finite entries), its math patch (registered under its id in
`runtime/patches.py`), or the guard of the origin op (`OriginGuardPatch`, made here from
the op and source line the replay named). This module is the engine: how each change is
applied (`CHANGES`), and the replay. The replay rebuilds the run from its start (the same
seed, or the checkpoint), so it sees the same initial weights and the same batches,
applies the fix for the whole run, as a user would, and runs **past the failing step by a
horizon** (a quarter of the steps to the failure, at least 32).

Surviving the horizon *and still learning* (learning.py) verifies the fix; staying finite
without learning, or failing anywhere, does not, with the reason; a fix that could not be
applied (nothing to rewrite) gives way to the cause's next one; running out of the time
budget leaves it unverified. `verify_all` then re-ranks the causes by what their replays
showed (`causes.ranking.rerank`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from nandoctor.causes.case import Case
from nandoctor.causes.index import FIXES
from nandoctor.causes.ranking import Replay, rerank
from nandoctor.causes.unit import Change, Fix, fixes_for
from nandoctor.causes.words import OVERFLOWED
from nandoctor.diagnose.learning import learning_of
from nandoctor.errors import NandoctorError
from nandoctor.registry import Registry
from nandoctor.report.types import Cause
from nandoctor.runtime.fast_run import fast_run
from nandoctor.runtime.patches import PATCHES, MathPatch, OpSite, OriginGuardPatch
from nandoctor.runtime.probe import Probe
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.safe_ops import family
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import Session, build_session

MIN_HORIZON = 32


@dataclass(frozen=True)
class Plan:
    """One fix to replay: a changed config, a patch or input filter, a change to the
    session once built (`prepare`: the loaded weights' non-finite entries zeroed)."""

    describe: str
    loaded: LoadedConfig
    patch: Callable[[], MathPatch] | None = None
    skip_nonfinite_batches: bool = False
    prepare: Callable[[Session], None] | None = None


@dataclass(frozen=True)
class Verdict:
    """What one replay showed: `verified` and the sentence the report carries."""

    replay: Replay
    sentence: str
    applied: bool = True  # False: the fix found nothing to change; the next one may

    @property
    def verified(self) -> bool | None:
        return {Replay.HELD: True, Replay.NOT_REPLAYED: None}.get(self.replay, False)


Applier = Callable[[Case, LoadedConfig], Plan | None]
CHANGES: Registry[Applier] = Registry("config change")


def applies(change: Change) -> Callable[[Applier], Applier]:
    """Register how `change` is applied: the plan, or None where it cannot be."""

    def register(fn: Applier) -> Applier:
        CHANGES.add(change.name, fn, by=f"{fn.__module__}.{fn.__qualname__}")
        return fn

    return register


@applies(Change.BFLOAT16)
def _bfloat16(case: Case, loaded: LoadedConfig) -> Plan | None:
    if case.facts.dtype != "float16":
        return None
    return Plan(
        "with bfloat16 autocast instead of float16", loaded.with_overrides(dtype="bfloat16")
    )


@applies(Change.CLIP_GRAD_NORM)
def _clip(case: Case, loaded: LoadedConfig) -> Plan | None:
    clip = loaded.config.clip_grad_norm
    if clip is not None and clip <= 1.0:
        return None
    return Plan(
        "with unscale_ then clip_grad_norm_(1.0)", loaded.with_overrides(clip_grad_norm=1.0)
    )


@applies(Change.SMALLER_LR)
def _smaller_lr(case: Case, loaded: LoadedConfig) -> Plan | None:
    """The config's lr / 10: with a scheduler that multiplies it, the rate in effect at
    every step is 10x smaller too; the sentence quotes the rate in effect when known."""
    optimizer = loaded.config.optimizer
    lr = optimizer.kwargs.get("lr")
    if not isinstance(lr, (int, float)):
        return None
    smaller = optimizer.model_copy(update={"lr": lr / 10})
    effect, step = case.facts.lr, case.first.step
    if effect is not None and not _close(effect, lr):
        what = f"{effect / 10:g} in effect at step {step}, instead of {effect:g}"
    else:
        what = f"{lr / 10:g}"
    return Plan(
        f"with a 10x smaller learning rate ({what})", loaded.with_overrides(optimizer=smaller)
    )


@applies(Change.SKIP_NONFINITE_BATCHES)
def _filter_inputs(case: Case, loaded: LoadedConfig) -> Plan | None:
    return Plan("with batches holding NaN or inf skipped", loaded, skip_nonfinite_batches=True)


@applies(Change.OPTIMIZER_EPS)
def _optimizer_eps(case: Case, loaded: LoadedConfig) -> Plan | None:
    optimizer = loaded.config.optimizer
    if optimizer.name is None:
        return None
    eps = max(1e-8, float(torch.finfo(getattr(torch, case.facts.param_dtype)).tiny))
    raised = optimizer.model_copy(update={"eps": eps})
    return Plan(
        f"with the optimizer's eps raised to {eps:g}", loaded.with_overrides(optimizer=raised)
    )


@applies(Change.ZERO_NONFINITE_WEIGHTS)
def _zero_weights(case: Case, loaded: LoadedConfig) -> Plan | None:
    if loaded.config.checkpoint is None:
        return None  # NB: weights that went bad during the run are not "loaded" ones
    return Plan(
        "with the non-finite entries of the loaded weights and optimizer state zeroed",
        loaded,
        prepare=zero_nonfinite,
    )


def zero_nonfinite(session: Session) -> None:
    """Zero every NaN and inf in the session's weights, buffers and optimizer state."""
    with torch.no_grad():
        for t in [*session.model.parameters(), *session.model.buffers()]:
            if t.is_floating_point():
                t.nan_to_num_(0.0, 0.0, 0.0)
        for state in session.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.nan_to_num_(0.0, 0.0, 0.0)


def origin_site(case: Case) -> OpSite | None:
    """Where the origin op ran, as the guard needs it: its family (the forward function's,
    for a failure in a backward), and its line: that of the library file it ran in when
    the report shows one past torch's own (a transformers modeling file), else the
    user's; None when the replay named no op or no user line."""
    first = case.first
    if first.op is None or not first.source or not _line_of(first.source):
        return None
    backward_of = case.evidence.backward_of
    name = backward_of.split(" ")[0] if first.phase == "backward" and backward_of else first.op
    fam, overflowed = family(name)[0], first.value in OVERFLOWED
    library = next((f for f in first.frames if not f.user and not _torchs(f.file)), None)
    if library is not None:
        return OpSite(fam, library.file, library.line, overflowed, library=True)
    path, line = first.source.rpartition(":")[0], _line_of(first.source)
    return OpSite(fam, os.path.realpath(path), line, overflowed)


def _torchs(shown: str) -> bool:
    """A frame of torch's own (`F.softmax`'s body): every softmax passes through it."""
    return shown.split("/", 1)[0] == "torch"


def _line_of(source: str) -> int:
    line = source.rpartition(":")[2]
    return int(line) if line.isdigit() else 0


def plan(cause_id: str, fix: Fix, case: Case, loaded: LoadedConfig) -> Plan | None:
    """The replay `fix` asks for: its config change applied, its cause's patch attached,
    or the origin op guarded; None when it cannot be applied to this run."""
    if fix.guard:
        site = origin_site(case)
        if site is None:
            return None
        guard = OriginGuardPatch(site)
        return Plan(f"with {guard.describe}", loaded, patch=lambda: OriginGuardPatch(site))
    changed = Plan("", loaded) if fix.change is None else CHANGES[fix.change.name](case, loaded)
    if changed is None or not fix.patch:
        return changed
    patch = PATCHES[cause_id]
    words = f"{changed.describe} and" if changed.describe else "with"
    return replace(changed, describe=f"{words} {patch.describe}", patch=patch)


def verify_all(
    causes: list[Cause], case: Case, loaded: LoadedConfig, deadline: float
) -> list[Cause]:
    """Every cause with its fix replayed (within the budget), re-ranked by the replays."""
    return rerank([check(cause, case, loaded, deadline) for cause in causes])


def verify(cause: Cause, case: Case, loaded: LoadedConfig, deadline: float) -> Cause:
    """The cause with `verified` and a `verification` sentence, when a fix applies."""
    return check(cause, case, loaded, deadline)[0]


def check(cause: Cause, case: Case, loaded: LoadedConfig, deadline: float) -> tuple[Cause, Replay]:
    """Replay the cause's fixes in order until one holds; the cause with the verdict of
    the best one (the sentences of those tried before it kept in front of its own)."""
    verdicts: list[Verdict] = []
    for fix in fixes_for(FIXES.get(cause.id, ()), case.first.phase) if case is not None else []:
        replayed = plan(cause.id, fix, case, loaded)
        if replayed is None:
            continue
        verdicts.append(_replay(replayed, case, deadline))
        if verdicts[-1].replay is Replay.HELD:
            break
    if not verdicts:
        return cause, Replay.NOT_REPLAYED
    best = combined(verdicts)
    return replace(cause, verified=best.verified, verification=best.sentence), best.replay


_BEST_FIRST = (Replay.HELD, Replay.STOPPED_LEARNING, Replay.REFUTED, Replay.NOT_REPLAYED)


def combined(verdicts: list[Verdict]) -> Verdict:
    """One verdict for several fixes of one cause: the best replay, saying what was tried
    (a fix that found nothing to change is mentioned only when nothing else ran)."""
    applied = [v for v in verdicts if v.applied] or verdicts
    best = min(applied, key=lambda v: _BEST_FIRST.index(v.replay))
    return Verdict(best.replay, "; ".join(v.sentence for v in applied), best.applied)


def horizon(case: Case) -> int:
    return max(MIN_HORIZON, (case.first.step - case.facts.start_step) // 4)


def _replay(plan: Plan, case: Case, deadline: float) -> Verdict:
    failing = case.first.step
    target = failing + horizon(case)
    steps = target - case.facts.start_step + 1
    if time.perf_counter() > deadline:
        return Verdict(
            Replay.NOT_REPLAYED, f"not verified {plan.describe}: the time budget ran out"
        )
    patch = plan.patch() if plan.patch else None
    try:
        session = build_session(plan.loaded)
        if plan.prepare is not None:
            plan.prepare(session)
        result = fast_run(
            session, steps, probe=patch or Probe(), deadline=deadline,
            skip_nonfinite_batches=plan.skip_nonfinite_batches,
        )  # fmt: skip
    except NandoctorError as e:
        why = f"not verified {plan.describe}: the replay failed: {e.message}"
        return Verdict(Replay.NOT_REPLAYED, why)
    except (MemoryError, torch.OutOfMemoryError):  # the report is still written
        why = f"not verified {plan.describe}: the replay ran out of memory"
        return Verdict(Replay.NOT_REPLAYED, why)
    return _judge(plan, patch, result, case, target, steps)


def _judge(
    plan: Plan, patch: MathPatch | None, result: RunResult, case: Case, target: int, steps: int
) -> Verdict:
    if result.status == "interrupted":
        raise KeyboardInterrupt
    if patch is not None and patch.hits == 0:
        why = f"not verified {plan.describe}: the patch found nothing to rewrite"
        return Verdict(Replay.NOT_REPLAYED, why, applied=False)
    if result.status == "timeout":
        reached = result.start_step + result.steps_run
        why = f"not verified {plan.describe}: the time budget ran out at step {reached} of {target}"
        return Verdict(Replay.NOT_REPLAYED, why)
    if result.failure is not None:
        f = result.failure
        phase = f.phase.value if f.phase else "?"
        why = f"{plan.describe}, the run still went non-finite at step {f.step} (phase {phase})"
        return Verdict(Replay.REFUTED, why)
    finite = f"{result.steps_run}/{steps} steps stayed finite, to step {target}"
    learning = learning_of(result.telemetry.loss, case.reference_loss)
    if not learning.learned:
        why = f"{plan.describe}, {finite}, but the run stopped learning: {learning.why}"
        return Verdict(Replay.STOPPED_LEARNING, why)
    fell = (
        f"; the loss fell from {learning.start:.3g} to {learning.end:.3g}"
        if learning.start is not None and learning.end is not None
        else ""
    )
    return Verdict(
        Replay.HELD, f"{plan.describe}, {finite}, past the failing step {case.first.step}{fell}"
    )


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
