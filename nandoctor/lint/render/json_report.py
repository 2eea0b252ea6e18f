"""`--json`: the findings as JSON, for scripts and CI. For example (abridged)::

{"schema_version": 1, "tool": {"name": "nandoctor", "version": "0.1.0"},
 "command": "lint", "status": "findings", "files_checked": 1, "suppressed": 0,
 "summary": {"error": 1, "warning": 1, "info": 0},
 "findings": [{"id": "log-of-softmax", "severity": "error", "title": "...",
               "path": "train.py", "line": 9, "column": 26, "end_line": 9,
               "end_column": 62, "message": "...", "fix": "...", "heuristic": false}],
 "skipped": [{"path": "broken.py", "line": 3, "column": 5, "reason": "invalid syntax"}]}
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from nandoctor.causes import catalog
from nandoctor.lint.findings import Finding, LintResult, Skipped
from nandoctor.version import __version__

SCHEMA_VERSION = 1


def to_json(result: LintResult) -> str:
    return json.dumps(to_dict(result), indent=2) + "\n"


def to_dict(result: LintResult) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "nandoctor", "version": __version__},
        "command": "lint",
        "status": "findings" if result.findings or result.skipped else "clean",
        "files_checked": result.files_checked,
        "suppressed": result.suppressed,
        "summary": {s.value: n for s, n in result.counts().items()},
        "findings": [_finding(f) for f in result.findings],
        "skipped": [_skipped(s) for s in result.skipped],
    }


def _skipped(skipped: Skipped) -> dict[str, Any]:
    fields = dataclasses.asdict(skipped)
    del fields["in_file"]  # NB: SARIF's; here a notebook's place is its cell and line
    return fields


def _finding(finding: Finding) -> dict[str, Any]:
    cause = catalog.get(finding.id)
    return {
        "id": finding.id,
        "severity": finding.severity.value,
        "title": cause.title,
        "path": finding.path,
        "line": finding.line,
        "column": finding.column,
        "end_line": finding.end_line,
        "end_column": finding.end_column,
        "message": finding.message,
        "fix": cause.fix,
        "heuristic": finding.heuristic,
        **({"cell": finding.cell} if finding.cell is not None else {}),
    }
