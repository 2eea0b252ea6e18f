"""What one check module declares: its function and its examples, as one `Check`.

A module per cause id keeps everything about a check in one file (ruff keeps one rule per
file for the same reason): the function `Source -> Iterable[Spot]`, its default severity, a
one-line summary and INVALID/VALID snippets (Fixit's idea): the tests run every snippet,
and docs/lint.md shows them. Title, explanation and fix come from the cause catalog, so
they are written once for diagnose, lint and docs. The module ends in `CHECK = Check(...)`,
which `lint.registry` lists; nothing is registered by importing a module.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nandoctor.causes import catalog
from nandoctor.causes.catalog import CauseInfo
from nandoctor.lint.findings import Severity
from nandoctor.lint.index import Located
from nandoctor.lint.source import Source


@dataclass(frozen=True)
class Spot:
    """One place a check objects to; `severity` None means the check's default."""

    node: Located
    message: str
    severity: Severity | None = None


CheckFunction = Callable[[Source], Iterable[Spot]]


@dataclass(frozen=True, kw_only=True)
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
