"""Which rank of a watched job a failure was born on (every rank is a watched process).

Data-parallel ranks combine their gradients every step, so a NaN born on one rank reaches
every rank in that same step. The rank whose batch, forward or loss went non-finite
fails before the backward; the others fail in it, when the all-reduce (DDP) or the
reduce-scatter (FSDP) hands them the value. A NaN born in one rank's own backward makes
every rank fail in the backward: there the replay tells them apart, as the first
non-finite op each rank's tracer met either came from a collective (inherited) or not
(its own: `results.received_from_peers`). `diagnose` reads each rank's gradients before
they are combined instead; `watch` cannot hook a DDP it did not build.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from nandoctor.localize.replay import Localization
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.verdict import Verdict
from nandoctor.watch.results import ChildRun, Trace, received_from_peers

_BEFORE_BACKWARD = (Phase.PARAMETERS, Phase.INPUT, Phase.FORWARD, Phase.LOSS)


@dataclass(frozen=True)
class JobRanks:
    world_size: int
    origin: tuple[int, ...]
    inherited: tuple[int, ...]
    per_rank: list[Localization] | None  # each rank's replay in rank order, if every rank's ran

    def on(self, failure: Verdict) -> Verdict:
        """The failure, saying which ranks it was born on and which inherited it."""
        reading = replace(failure.reading, origin_ranks=self.origin, inherited_ranks=self.inherited)
        return replace(failure, reading=reading)


def job_ranks(runs: list[ChildRun], step: int, traces: list[Trace]) -> JobRanks | None:
    """The ranks of a job that failed at `step`; None for a command of one process, or
    where no rank can be named the origin (the ranks' replays found no op of their own)."""
    ranked = [r for r in runs if r.rank is not None and r.world_size is not None]
    if not ranked or ranked[0].world_size is None:
        return None
    world = ranked[0].world_size
    replayed = {t.rank: t.located for t in traces if _usable(t) and t.rank is not None}
    origin: list[int] = []
    inherited: list[int] = []
    unsure: list[int] = []
    for run in sorted(ranked, key=lambda r: r.rank or 0):
        if run.rank is None:
            continue
        failure = run.result.failure
        failed = failure is not None and failure.step == step
        found = replayed[run.rank].finding if run.rank in replayed else None
        if failed and failure is not None and failure.phase in _BEFORE_BACKWARD:
            origin.append(run.rank)
        elif found is not None and found.phase is not Phase.PARAMETERS:
            # NB: a rank whose GradScaler skipped the step did not fail: its replay still
            # says where its non-finite gradients came from
            (inherited if received_from_peers(found) else origin).append(run.rank)
        elif failed:
            unsure.append(run.rank)
    if not origin:
        return None
    # NB: a rank that failed in the backward of a step another rank's batch, forward or loss
    # broke got it from that rank, replayed or not
    inherited = sorted(inherited + unsure)
    per_rank = [replayed[r] for r in range(world)] if set(replayed) >= set(range(world)) else None
    return JobRanks(world, tuple(origin), tuple(inherited), per_rank)


def _usable(trace: Trace) -> bool:
    return trace.reached and trace.diverged is None
