"""Assemble the same `Report` as `diagnose` from what a guarded or watched run saw.

The pieces are diagnose's own (`assemble.report_from`; the rules through
`diagnose.case_of` and `rank`); only their inputs differ: the run's
settings come from what the hooks discovered (`guard.facts`) rather than from a config,
and there is no what-if verification (nandoctor does not control a user's loop), so
`verified` stays null.
"""

from __future__ import annotations

from nandoctor.causes.case import RunFacts
from nandoctor.causes.ranking import rank
from nandoctor.diagnose.assemble import report_from
from nandoctor.diagnose.engine import case_of
from nandoctor.localize.replay import Localization
from nandoctor.report.types import Environment, Report
from nandoctor.runtime.fast_run import RunResult


def build_report(
    command: str,
    config: str,
    environment: Environment,
    facts: RunFacts | None,
    result: RunResult,
    located: Localization | None = None,
    notes: list[str] | None = None,
) -> Report:
    report = report_from(command, config, environment, result, located, notes or [])
    if report.first_nonfinite is not None and facts is not None:
        report.causes = rank(case_of(report, facts))
    return report
