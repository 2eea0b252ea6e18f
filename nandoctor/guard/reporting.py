"""Assemble the same `Report` as `diagnose` from what a guarded or watched run saw.

The pieces are diagnose's own (`assemble.first_nonfinite`, `summarize`, `evidence_of`;
the rules through `diagnose.case_of` and `rank`); only their inputs differ: the run's
settings come from what the hooks discovered (`guard.facts`) rather than from a config,
and there is no what-if verification (nandoctor does not control a user's loop), so
`verified` stays null.
"""

from __future__ import annotations

from nandoctor import __version__
from nandoctor.assemble import evidence_of, first_nonfinite, summarize
from nandoctor.diagnose import case_of
from nandoctor.diagnosis.case import RunFacts
from nandoctor.diagnosis.rules import rank
from nandoctor.localize import Localization
from nandoctor.replay import RunResult
from nandoctor.report import Environment, Report, Tool


def build_report(
    command: str,
    config: str,
    environment: Environment,
    facts: RunFacts | None,
    result: RunResult,
    located: Localization | None = None,
    notes: list[str] | None = None,
) -> Report:
    notes = list(notes or [])
    if located is not None and located.note and located.reproduced:
        notes.append(located.note)
    if located is not None and not located.reproduced:
        notes.append(
            f"the instrumented replay of step {located.step} saw no non-finite value"
            + (f" ({located.note})" if located.note else ": nondeterministic or transient")
        )
    timing = {"run_s": round(result.seconds, 3)}
    if located is not None:
        timing["replay_s"] = round(located.seconds, 3)
    report = Report(
        command=command,
        config=config,
        environment=environment,
        status=result.status,
        steps_completed=result.steps_completed,
        summary=summarize(result, located),
        first_nonfinite=first_nonfinite(result, located),
        events=result.events,
        telemetry=result.telemetry,
        evidence=evidence_of(located),
        notes=notes,
        timing=timing,
        tool=Tool(version=__version__),
    )
    if report.first_nonfinite is not None and facts is not None:
        report.causes = rank(case_of(report, facts))
    return report
