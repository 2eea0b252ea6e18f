"""The rules' view of a failure (`Case`), built from what the engines returned, and the
causes the rules rank from it: the same for `diagnose`, `Guard` and `watch`.

The case is made of the sentinel's verdict and the replay's finding (through the same
converters as the report, so both say the same), never read back from a report.
"""

from __future__ import annotations

from nandoctor.causes.case import Case, Collapse, RunFacts
from nandoctor.causes.ranking import rank
from nandoctor.diagnose.assemble import evidence_of, first_nonfinite
from nandoctor.localize.replay import Localization
from nandoctor.report.evidence import Evidence
from nandoctor.report.trends import trends_of
from nandoctor.report.types import Cause
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.verdict import Verdict


def case_of(result: RunResult, located: Localization | None, facts: RunFacts) -> Case | None:
    """What the rules read: where the failure was seen, its evidence, the telemetry's
    trends, the run's settings and the verdict's collapse; None when the run did not fail."""
    first = first_nonfinite(result, located)
    if first is None:
        return None
    evidence = evidence_of(located) or Evidence()
    trends = trends_of(result.telemetry, result.events)
    before = _losses_before(result, first.step)
    healed = tuple(located.transients) if located is not None else ()
    loss = _loss_at(result, first.step)
    collapse = collapse_of(result.failure)
    return Case(first, evidence, trends, facts, before, healed, loss, collapse=collapse)


def collapse_of(failure: Verdict | None) -> Collapse | None:
    """The collapse of the GradScaler's scale the failure was, read from its verdict (NB:
    the one record of it: a recheck or a replay that learns more makes a new verdict)."""
    if failure is None or not failure.collapsed:
        return None
    return Collapse(failure.why, unchecked=failure.collapsed_unchecked)


def _losses_before(result: RunResult, step: int) -> tuple[tuple[int, float], ...]:
    """The original run's (step, loss) at the steps before the failing one."""
    t = result.telemetry
    return tuple((s, loss) for s, loss in zip(t.step, t.loss, strict=False) if s < step)


def _loss_at(result: RunResult, step: int) -> float | None:
    """The original run's loss at `step` (None: not recorded)."""
    t = result.telemetry
    return next((loss for s, loss in zip(t.step, t.loss, strict=False) if s == step), None)


def causes_of(
    result: RunResult, located: Localization | None, facts: RunFacts | None
) -> list[Cause]:
    """The ranked causes of a failure, unverified (none without a failure or settings)."""
    case = case_of(result, located, facts) if facts is not None else None
    return rank(case) if case is not None else []
