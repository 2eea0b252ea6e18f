"""`rank`: run every rule on a case and order the causes that hold, best first; `rerank`:
order them again once their fixes were replayed.

Several causes can hold at once (a softmax that underflowed in a run whose gradients grew);
the report lists them all with their confidence and evidence, and the what-if engine then
replays the fixes of each. A replay is stronger evidence than a rule's reading of the
telemetry, so after the replays the order is, deterministically:

1. causes whose fix held (the run got past the failing step and kept learning) and causes
   with no replay, by confidence;
2. causes whose fix held, but left the run's loss far above (10x) where another held fix
   left it (`BEHIND`: finite and learning, yet not the fix that made it train), by
   confidence;
3. causes whose fix kept the run finite but stopped it learning, and causes whose fix
   acts over the whole run (a learning rate, a clip, a dtype) and was refuted only from a
   snapshot shortly before the failure (`REFUTED_LATE`: too late to tell; replaying it
   from step 0 did not fit the budget), their confidence x 0.8;
4. causes whose fix was refuted (the run still went non-finite), their confidence x 0.5.

A cause whose fix held therefore always outranks one whose fix was refuted. Ties keep the
order of `index.CAUSES`.
"""

from __future__ import annotations

import dataclasses
from enum import Enum

from nandoctor.causes.case import Case
from nandoctor.causes.index import CATALOG, RULES
from nandoctor.report.types import Cause


class Replay(str, Enum):
    """What replaying a cause's fix showed."""

    HELD = "held"  # finite past the failing step, and still learning
    BEHIND = "held-behind"  # held, its loss ending far above another held fix's
    STOPPED_LEARNING = "stopped-learning"  # finite, but the loss stalled or diverged
    REFUTED = "refuted"  # still went non-finite
    # still went non-finite, applied only from a snapshot shortly before the failure: a
    # fix whose effect builds up over the run, not replayed from step 0 (the budget)
    REFUTED_LATE = "refuted-late"
    NOT_REPLAYED = "not-replayed"  # no fix to apply, nothing rewritten, or no time left


# a finite run whose loss ends this many times another's does not train as that one does:
# a fix that left it there trails the other fix (`Replay.BEHIND`), and `compare` never
# switches to a dtype that left it there (bfloat16 finite at 46720 beside float32 at 0.14)
FAR_BEHIND = 10.0

# (tier, factor on the confidence): the tier orders, the factor shows it in the number
_STANDING = {
    Replay.HELD: (0, 1.0),
    Replay.NOT_REPLAYED: (0, 1.0),
    Replay.BEHIND: (1, 1.0),
    Replay.STOPPED_LEARNING: (2, 0.8),
    Replay.REFUTED_LATE: (2, 0.8),
    Replay.REFUTED: (3, 0.5),
}


def rank(case: Case) -> list[Cause]:
    """Every cause whose rule holds, most confident first."""
    causes = []
    for cause_id, fn in RULES.items():
        hit = fn(case)
        if hit is not None:
            info = CATALOG[cause_id]
            fix = hit.fix or info.fix
            causes.append(Cause(cause_id, info.title, round(hit.confidence, 2), hit.evidence, fix))
    return sorted(causes, key=lambda c: -c.confidence)


def rerank(replayed: list[tuple[Cause, Replay]]) -> list[Cause]:
    """The causes in the order their replays put them (see the module's docstring), each
    with its confidence lowered when its fix was refuted or stopped the run learning."""
    standing = []
    for index, (cause, replay) in enumerate(replayed):
        tier, factor = _STANDING[replay]
        lowered = dataclasses.replace(cause, confidence=round(cause.confidence * factor, 2))
        standing.append((tier, -lowered.confidence, index, lowered))
    return [cause for *_, cause in sorted(standing, key=lambda s: s[:3])]
