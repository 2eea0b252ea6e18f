"""`--sarif`: SARIF 2.1.0, the format GitHub code scanning (and most CI dashboards) read.

One run; `tool.driver.rules` lists every check with its catalog title, explanation and
fix; each result names its rule, level, message and region. Files that could not be
linted become `toolExecutionNotifications`. For example (abridged)::

    {"version": "2.1.0", "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
     "runs": [{"tool": {"driver": {"name": "nandoctor", "rules": [{"id": "log-of-softmax",
        "shortDescription": {"text": "log of a softmax that underflowed to 0"}, ...}]}},
       "results": [{"ruleId": "log-of-softmax", "level": "error",
         "message": {"text": "Use `F.log_softmax` ..."},
         "locations": [{"physicalLocation": {"artifactLocation": {"uri": "train.py"},
           "region": {"startLine": 9, "startColumn": 26, ...}}}]}]}]}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

from nandoctor.lint.findings import Finding, LintResult, Severity, Skipped
from nandoctor.lint.registry import all_checks
from nandoctor.lint.unit import Check
from nandoctor.version import __version__

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
LEVELS = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}
SRCROOT = "%SRCROOT%"


def to_sarif(result: LintResult) -> str:
    return json.dumps(to_dict(result), indent=2) + "\n"


def to_dict(result: LintResult) -> dict[str, Any]:
    checks = list(all_checks().values())
    index = {c.id: i for i, c in enumerate(checks)}
    run = {
        "tool": {
            "driver": {
                "name": "nandoctor",
                "version": __version__,
                "semanticVersion": __version__,
                "rules": [rule(c) for c in checks],
            }
        },
        "originalUriBaseIds": {SRCROOT: {"uri": Path.cwd().resolve().as_uri() + "/"}},
        "columnKind": "unicodeCodePoints",
        "results": [_result(f, index[f.id]) for f in result.findings],
        "invocations": [
            {
                "executionSuccessful": True,
                "toolExecutionNotifications": [_notification(s) for s in result.skipped],
            }
        ],
    }
    return {"version": "2.1.0", "$schema": SCHEMA, "runs": [run]}


def rule(check: Check) -> dict[str, Any]:
    cause = check.cause
    tags = ["nandoctor", "numerics", "heuristic" if check.heuristic else "correctness"]
    return {
        "id": check.id,
        "name": "".join(part.capitalize() for part in check.id.split("-")),
        "shortDescription": {"text": cause.title},
        "fullDescription": {"text": check.summary},
        "help": {
            "text": f"{cause.explanation}\n\nFix: {cause.fix}",
            "markdown": _help_markdown(check),
        },
        "defaultConfiguration": {"level": LEVELS[check.severity]},
        "properties": {"tags": tags, "precision": "low" if check.heuristic else "high"},
    }


def _help_markdown(check: Check) -> str:
    cause = check.cause
    return (
        f"{cause.explanation}\n\n**Fix.** {cause.fix}\n\n"
        f"Before:\n```python\n{cause.before}\n```\n\nAfter:\n```python\n{cause.after}\n```\n\n"
        f"Suppress one line with `# nandoctor: ignore[{check.id}]`."
    )


def _result(finding: Finding, rule_index: int) -> dict[str, Any]:
    line, column, end_line, end_column = finding.in_file or (
        finding.line,
        finding.column,
        finding.end_line,
        finding.end_column,
    )
    region: dict[str, Any] = {
        "startLine": line,
        "startColumn": column,
        "endLine": end_line,
        "endColumn": end_column,
        "snippet": {"text": finding.code},
    }
    if finding.cell is not None and finding.in_file is None:  # NB: never a wrong line
        region = {"snippet": region["snippet"]}
    return {
        "ruleId": finding.id,
        "ruleIndex": rule_index,
        "level": LEVELS[finding.severity],
        "message": {"text": finding.message},
        "locations": [
            {"physicalLocation": {"artifactLocation": _artifact(finding.path), "region": region}}
        ],
        "properties": {
            "heuristic": finding.heuristic,
            **_cell_properties(finding.cell, finding.line, finding.column),
        },
    }


def _cell_properties(cell: int | None, line: int | None, column: int | None) -> dict[str, Any]:
    """A notebook's place as users see it (the region counts in the .ipynb file)."""
    if cell is None:
        return {}
    return {"notebookCell": cell, "cellLine": line, "cellColumn": column}


def _notification(skipped: Skipped) -> dict[str, Any]:
    location: dict[str, Any] = {"artifactLocation": _artifact(skipped.path)}
    if skipped.in_file is not None:
        location["region"] = {"startLine": skipped.in_file[0], "startColumn": skipped.in_file[1]}
    elif skipped.line is not None and skipped.cell is None:
        location["region"] = {"startLine": skipped.line, "startColumn": skipped.column or 1}
    notification: dict[str, Any] = {
        "level": "error",
        "message": {"text": f"not linted: {skipped.reason}"},
        "locations": [{"physicalLocation": location}],
    }
    if skipped.cell is not None:
        notification["properties"] = _cell_properties(skipped.cell, skipped.line, skipped.column)
    return notification


def _artifact(path: str) -> dict[str, str]:
    """Relative paths stay relative to the repository root (`%SRCROOT%`), as GitHub wants;
    others become file URIs."""
    as_path = Path(path)
    if as_path.is_absolute():
        return {"uri": as_path.as_uri()}
    return {"uri": quote(as_path.as_posix()), "uriBaseId": SRCROOT}
