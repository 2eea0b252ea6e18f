"""What-if verification: apply a fix nandoctor can make itself, replay, see if it holds.

Which fixes apply to a cause is data in the cause's module (`FIXES` there, gathered in
`causes.index.FIXES`): a config change (`Change`: bfloat16, clipping, a 10x smaller
learning rate, a usable optimizer epsilon, skipping non-finite batches, zeroing the loaded
weights' non-finite entries), its math patch (registered under its id in
`runtime/patches.py`), or the guard of the origin op (`OriginGuardPatch`). How each is
turned into a replay of this run is plans.py (`plan`); this module is the engine: the
replay, and its verdict. A fix that no replay can show says why ("not replayed: ...").

A replay **resumes from the newest snapshot before the failure**, as a user resumes from a
checkpoint with the fix applied: a fresh session of the fixed config gets the snapshot's
weights, optimizer state, loss scale, scheduler and RNG states, skips the batches before
it (the stream draws its own randomness, so they are the batches the run saw) and runs
**past the failing step by `MIN_HORIZON` steps**. Its cost follows the horizon, not the
steps to the failure. A fix whose effect is where the run starts (`plans.Reach.LOADED`:
weights zeroed when loaded) is replayed from the run's start instead (the same seed, or
the checkpoint), past the failing step by a quarter of the steps to it (at least 32); so
is a fix refuted from the snapshot whose effect builds up over the run, when the replay
fits the budget of rewind.py (`Rewind`), since what broke may have begun before the
snapshot. The sentence says from which step the fix was applied.

A replay is judged as the run is (the same sentinel and judge: each GradScaler skip
rechecked at loss scale 1, so a NaN the scaler hid is a failure there too). Surviving the
horizon *and still learning* (learning.py) verifies the fix; staying finite without
learning, or failing anywhere, does not, with the reason; a fix that could not be applied
(nothing to rewrite) gives way to the cause's next one; running out of the time budget
leaves it unverified. `verify_all` then re-ranks the causes by what their replays showed
(`causes.ranking.rerank`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from nandoctor.causes.case import Case
from nandoctor.causes.index import FIXES
from nandoctor.causes.ranking import FAR_BEHIND, Replay, rerank
from nandoctor.causes.unit import fixes_for
from nandoctor.causes.words import num, plural
from nandoctor.diagnose.learning import learning_of, reference_loss
from nandoctor.diagnose.plans import Plan, Reach, Unplayable, plan
from nandoctor.diagnose.rewind import Rewind
from nandoctor.errors import NandoctorError, out_of_memory
from nandoctor.report.types import Cause
from nandoctor.runtime.fast_run import fast_run
from nandoctor.runtime.patches import MathPatch
from nandoctor.runtime.probe import Phase, Probe
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.snapshot import StateSnapshot
from nandoctor.runtime.tensors import host_copy
from nandoctor.runtime.verdict import Verdict
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import Session, build_session

MIN_HORIZON = 32


@dataclass(frozen=True)
class FixOutcome:
    """What one replay showed: `verified` and the sentence the report carries."""

    replay: Replay
    sentence: str
    applied: bool = True  # False: the fix found nothing to change; the next one may
    end: float | None = None  # a fix that held: its check's loss at the end (a window mean)

    @property
    def verified(self) -> bool | None:
        return {Replay.HELD: True, Replay.NOT_REPLAYED: None}.get(self.replay, False)


def verify_all(
    causes: list[Cause],
    case: Case,
    loaded: LoadedConfig,
    deadline: float,
    resume: StateSnapshot | None = None,
    rewind: Rewind = Rewind(),
) -> list[Cause]:
    """Every cause with its fix replayed (within the budget), re-ranked by the replays;
    from `resume`, the newest snapshot before the failure, where a fix allows it."""
    checked = [check(cause, case, loaded, deadline, resume, rewind) for cause in causes]
    return rerank(_behind_others(checked))


def _behind_others(checked: list[tuple[Cause, FixOutcome]]) -> list[tuple[Cause, Replay]]:
    """The replays as `rerank` weighs them: a fix that held, but whose run ended
    `FAR_BEHIND` times above another held fix's, trails it (a bfloat16 switch that keeps
    a run finite whose learning rate is 10x too high, beside the smaller rate). A ratio
    says that only of positive losses: a loss that reaches 0 or below (a Gaussian's
    log-likelihood) is never weighed so."""
    ends = [v.end if v.replay is Replay.HELD and (v.end or 0) > 0 else None for _, v in checked]
    held = [(end, cause) for end, (cause, _) in zip(ends, checked, strict=True) if end]
    if not held:
        return [(cause, verdict.replay) for cause, verdict in checked]
    best, ahead = min(held, key=lambda pair: pair[0])
    out = []
    for (cause, verdict), end in zip(checked, ends, strict=True):
        if end is None or end < FAR_BEHIND * best:
            out.append((cause, verdict.replay))
            continue
        behind = (
            f"; its loss ended {end / best:.3g}x above where the {ahead.id} fix left it "
            f"({num(end)} against {num(best)})"
        )
        out.append((replace(cause, verification=f"{cause.verification}{behind}"), Replay.BEHIND))
    return out


def verify(
    cause: Cause,
    case: Case,
    loaded: LoadedConfig,
    deadline: float,
    resume: StateSnapshot | None = None,
) -> Cause:
    """The cause with `verified` and a `verification` sentence, when a fix applies."""
    return check(cause, case, loaded, deadline, resume)[0]


def check(
    cause: Cause,
    case: Case,
    loaded: LoadedConfig,
    deadline: float,
    resume: StateSnapshot | None = None,
    rewind: Rewind = Rewind(),
) -> tuple[Cause, FixOutcome]:
    """Replay the cause's fixes in order until one holds; the cause with the verdict of
    the best one (the sentences of those tried before it kept in front of its own)."""
    verdicts: list[FixOutcome] = []
    rewind = rewind.of(cause.id)
    for fix in fixes_for(FIXES.get(cause.id, ()), case.first.phase) if case is not None else []:
        replayed = plan(cause.id, fix, case, loaded)
        if replayed is None:
            continue
        if isinstance(replayed, Unplayable):  # NB: said only when no other fix ran
            verdicts.append(FixOutcome(Replay.NOT_REPLAYED, f"not replayed: {replayed.why}", False))
            continue
        verdicts.append(_replay(replayed, case, loaded, deadline, resume, rewind))
        if verdicts[-1].replay is Replay.HELD:
            break
    if not verdicts:
        return cause, FixOutcome(Replay.NOT_REPLAYED, "")
    best = combined(verdicts)
    return replace(cause, verified=best.verified, verification=best.sentence), best


_BEST_FIRST = (
    Replay.HELD,
    Replay.STOPPED_LEARNING,
    Replay.REFUTED_LATE,
    Replay.REFUTED,
    Replay.NOT_REPLAYED,
)


def combined(verdicts: list[FixOutcome]) -> FixOutcome:
    """One verdict for several fixes of one cause: the best replay, saying what was tried
    (a fix that found nothing to change is mentioned only when nothing else ran)."""
    applied = [v for v in verdicts if v.applied] or verdicts
    best = min(applied, key=lambda v: _BEST_FIRST.index(v.replay))
    return FixOutcome(best.replay, "; ".join(v.sentence for v in applied), best.applied, best.end)


def horizon(case: Case) -> int:
    """Steps past the failing step a replay from the run's start must survive."""
    return max(MIN_HORIZON, (case.first.step - case.facts.start_step) // 4)


def _replay(
    plan: Plan,
    case: Case,
    original: LoadedConfig,
    deadline: float,
    resume: StateSnapshot | None,
    rewind: Rewind,
) -> FixOutcome:
    """From the snapshot where the plan allows it; from the start where it must, or where
    the snapshot's replay was refuted and `rewind` replays it again from there."""
    if resume is None or plan.from_start or resume.step <= case.facts.start_step:
        return run_plan(plan, case, deadline, rewind=rewind)
    started = time.perf_counter()
    resumed = run_plan(plan, case, deadline, Resume(resume, original), rewind)
    if resumed.replay is not Replay.REFUTED:
        return resumed
    per_step = rewind.step_seconds or (time.perf_counter() - started) / max(
        1, case.first.step + MIN_HORIZON - resume.step
    )
    start = case.facts.start_step
    whole = case.first.step + horizon(case) - start + 1
    why_not = rewind.why_not(plan, start, whole, per_step, deadline)
    refuted = f"{resumed.sentence}; refuted from step {resume.step}"
    # NB: a fix acting over the whole run, refuted from the snapshot alone, is refuted late
    late = Replay.REFUTED_LATE if plan.reach is Reach.HISTORY else Replay.REFUTED
    if why_not is not None:
        return replace(resumed, replay=late, sentence=f"{refuted}{why_not}")
    again = run_plan(plan, case, deadline, rewind=rewind)
    said_again = again.sentence.removeprefix(f"{plan.describe}, ")
    if again.replay is Replay.NOT_REPLAYED:  # NB: out of time on the way: the refutation stands
        why = again.sentence.removeprefix(f"not verified {plan.describe}: ")
        sentence = f"{refuted} only: replayed from step {start}, {why}"
        return replace(resumed, replay=late, sentence=sentence)
    return FixOutcome(again.replay, f"{resumed.sentence}; {said_again}", again.applied, again.end)


@dataclass(frozen=True)
class Resume:
    """Where a replay resumes: the snapshot, and the config it was taken under (the
    fixed config's optimizer settings that differ from it are applied after loading)."""

    snapshot: StateSnapshot
    original: LoadedConfig

    def apply(self, session: Session, fixed: LoadedConfig) -> None:
        """Load the snapshot into `session`, keeping the fix's optimizer settings: a
        changed `lr` scales the rate in effect (and a scheduler's base rates) by the same
        factor, as a user who resumes with a smaller rate sees it."""
        self.snapshot.restore(session)
        before = self.original.config.optimizer.kwargs
        changed = {k: v for k, v in fixed.config.optimizer.kwargs.items() if before.get(k) != v}
        factor = _factor(before.get("lr"), changed.pop("lr", None))
        for group in session.optimizer.param_groups:
            group.update(changed)
            for key in ("lr", "initial_lr") if factor is not None else ():
                if key in group:
                    group[key] = group[key] * factor
        scheduler = session.scheduler
        base_lrs = getattr(scheduler, "base_lrs", None)
        if factor is not None and scheduler is not None and base_lrs is not None:
            scheduler.base_lrs = [lr * factor for lr in base_lrs]
        session.start_step = self.snapshot.step

    def batches(self, session: Session) -> Iterable[tuple[int, Any]]:
        """The steps from the snapshot's on, as the run drew them (`BatchStream.resumed`);
        skipped to from the data's first batch where the snapshot does not say where the
        data stood."""
        data = self.snapshot.data
        if data is not None:  # NB: a copy of the kept batch: a loss may write into its batch
            return session.batches.resumed(replace(data, batch=host_copy(data.batch)))
        return itertools.islice(session.batches, self.snapshot.step - session.start_step, None)


def _factor(before: Any, after: Any) -> float | None:
    numbers = isinstance(before, (int, float)) and isinstance(after, (int, float))
    return after / before if numbers and before else None


def run_plan(
    plan: Plan,
    case: Case,
    deadline: float,
    resume: Resume | None = None,
    rewind: Rewind = Rewind(),
) -> FixOutcome:
    """Replay `plan` from the run's start, or from `resume`, past the failing step."""
    start = resume.snapshot.step if resume is not None else case.facts.start_step
    target = case.first.step + (MIN_HORIZON if resume is not None else horizon(case))
    steps = target - start + 1
    if time.perf_counter() > deadline:
        return FixOutcome(
            Replay.NOT_REPLAYED, f"not verified {plan.describe}: the time budget ran out"
        )
    rewind.started(plan, start, target, resumed=resume is not None)
    patch = plan.patch() if plan.patch else None
    try:
        session = build_session(plan.loaded)
        batches = None
        if resume is not None:
            batches = resume.batches(session)
            resume.apply(session, plan.loaded)
        if plan.prepare is not None:
            plan.prepare(session)
        result = fast_run(
            session, steps, probe=patch or Probe(), deadline=deadline,
            skip_nonfinite_batches=plan.skip_nonfinite_batches, batches=batches,
            on_step=rewind.on_step,
        )  # fmt: skip
    except NandoctorError as e:
        why = f"not verified {plan.describe}: the replay failed: {e.message}"
        return FixOutcome(Replay.NOT_REPLAYED, why)
    except Exception as e:  # NB: the report is still written (the CPU's is a RuntimeError)
        if not out_of_memory(e):
            raise
        why = f"not verified {plan.describe}: the replay ran out of memory"
        return FixOutcome(Replay.NOT_REPLAYED, why)
    return _judge(plan, patch, result, case, target, steps, resume is not None)


def _judge(
    plan: Plan,
    patch: MathPatch | None,
    result: RunResult,
    case: Case,
    target: int,
    steps: int,
    resumed: bool,
) -> FixOutcome:
    if result.status == "interrupted":
        raise KeyboardInterrupt
    if patch is not None and patch.hits == 0:
        why = f"not verified {plan.describe}: the patch found nothing to rewrite"
        return FixOutcome(Replay.NOT_REPLAYED, why, applied=False)
    if result.status == "timeout":
        reached = result.start_step + result.steps_run
        why = f"not verified {plan.describe}: the time budget ran out at step {reached} of {target}"
        return FixOutcome(Replay.NOT_REPLAYED, why)
    where = f"applied from step {result.start_step}"
    fixed = f"{plan.describe}, {where}{' (resumed from a snapshot)' if resumed else ''}"
    if result.failure is not None:
        return FixOutcome(Replay.REFUTED, f"{fixed}, {_still_failed(result.failure, case)}")
    finite = f"{result.steps_run}/{steps} steps stayed finite, to step {target}"
    skipped = sum(e.kind == "skipped-batch" for e in result.events)
    if skipped:  # NB: not "33/38 stayed finite": the other 5 did not fail, they never ran
        run = plural(result.steps_run, "step")
        were = "was" if skipped == 1 else "were"
        finite = f"{run} stayed finite and {skipped} {were} skipped, to step {target}"
    if skipped > result.steps_run:  # NB: 0 trained of 33 was "verified"
        why = (
            f"{fixed}, {finite}, but it skipped more batches than it trained on: NaN or inf "
            "is in most batches, so dropping them is no fix (find where it comes from)"
        )
        return FixOutcome(Replay.STOPPED_LEARNING, why)
    t = result.telemetry
    learning = learning_of(list(zip(t.step, t.loss, strict=True)), case.losses, resumed=resumed)
    if not learning.learned:
        why = f"{fixed}, {finite}, but the run stopped learning: {learning.why}"
        return FixOutcome(Replay.STOPPED_LEARNING, why)
    loss = _loss_words(learning.start, learning.end, reference_loss(case.losses))
    held = f"{fixed}, {finite}, past the failing step {case.first.step}{loss}"
    return FixOutcome(Replay.HELD, held, end=learning.end)


def _still_failed(f: Verdict, case: Case) -> str:
    """Where and how the fixed run failed all the same, as a clause. A NaN the scaler
    skipped is named as such: the replay got past that step only in the sense a plain
    run of the fixed config would not (its gradients are non-finite at loss scale 1)."""
    if f.hidden:
        again = f.step == case.first.step and case.first.phase == Phase.BACKWARD.value
        same = "the same NaN" if again else "a NaN"
        return (
            f"the scaler hid {same} at step {f.step}: it skipped the step, but its gradients "
            "are non-finite at loss scale 1 too"
        )
    # NB: a replay's sentinel leaves the model's output to the loss (not `thorough`): a
    # NaN the forward made shows in the loss, as diagnosing it would place in forward
    phase = "forward or loss" if f.phase is Phase.LOSS else (f.phase.value if f.phase else "?")
    return f"the run still went non-finite at step {f.step} (phase {phase})"


def _loss_words(start: float | None, end: float | None, reference: float | None) -> str:
    """How the check's loss went, in the words its numbers allow (NB: a resumed check is
    judged against the original run's loss, and may hold level without falling)."""
    if start is None or end is None:
        return ""
    a, b = f"{start:.3g}", f"{end:.3g}"
    if end < start and a != b:
        return f"; the loss fell from {a} to {b}"
    if reference is not None:
        return f"; the loss held at {b} (the original run's was {reference:.3g})"
    return f"; the loss went from {a} to {b}"
