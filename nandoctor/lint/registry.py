"""The table of lint checks: one check per cause id, each a unit with its own examples.

A check is a function `Source -> Iterable[Hit]` registered with `@check(...)`, which also
declares its default severity, a one-line summary and INVALID/VALID snippets (Fixit's
idea): the tests run every snippet, and docs/lint.md shows them. Title, explanation and
fix come from the cause catalog, so they are written once for diagnose, lint and docs.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nandoctor.causes import catalog
from nandoctor.causes.catalog import CauseInfo
from nandoctor.lint.findings import Severity
from nandoctor.lint.source import Source
from nandoctor.registry import Registry


@dataclass(frozen=True)
class Hit:
    """One place a check objects to; `severity` None means the check's default."""

    node: ast.AST
    message: str
    severity: Severity | None = None


CheckFunction = Callable[[Source], Iterable[Hit]]


@dataclass(frozen=True)
class Check:
    id: str  # a cause id of SPEC.md, also the id users select, ignore and suppress
    severity: Severity
    summary: str  # what the check looks for, one sentence (docs, SARIF)
    run: CheckFunction
    invalid: tuple[str, ...]  # snippets it must flag
    valid: tuple[str, ...]  # snippets it must leave alone
    heuristic: bool = False  # a pattern that is often fine; findings say so

    @property
    def cause(self) -> CauseInfo:
        return catalog.get(self.id)


CHECKS: Registry[Check] = Registry("lint check")


def check(
    cause_id: str,
    *,
    severity: Severity,
    summary: str,
    invalid: Iterable[str],
    valid: Iterable[str],
    heuristic: bool = False,
) -> Callable[[CheckFunction], CheckFunction]:
    """Register a check under `cause_id`, which must be in the catalog, once: a second
    check for the id raises `DuplicateError` (a ValueError) naming both modules."""

    def register(run: CheckFunction) -> CheckFunction:
        catalog.get(cause_id)  # NB: fails at import for an id the catalog lacks
        unit = Check(cause_id, severity, summary, run, tuple(invalid), tuple(valid), heuristic)
        CHECKS.add(cause_id, unit, by=f"{run.__module__}.{run.__qualname__}")
        return run

    return register


def all_checks() -> dict[str, Check]:
    """Every registered check, by id, in the order docs and SARIF list them."""
    from nandoctor.lint.checks import ORDER  # NB: importing the package registers them

    rank = {cause_id: i for i, cause_id in enumerate(ORDER)}
    return dict(sorted(CHECKS.items(), key=lambda item: rank.get(item[0], len(rank))))
