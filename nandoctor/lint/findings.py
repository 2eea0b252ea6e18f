"""What `nandoctor lint` found: plain frozen data that every output format reads.

    Finding(id="log-of-softmax", severity=Severity.ERROR, path="train.py", line=9,
            column=26, end_line=9, end_column=67, message="`torch.log` of a softmax ...",
            code="            loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()")

Columns are 1-based and count characters (not UTF-8 bytes, which is what `ast` counts);
`end_column` is exclusive, as in SARIF. Nothing here imports torch.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from enum import Enum

from nandoctor.lint.index import Located

# A message's pointer to the line a value came from; in a notebook the engine rewrites it
# to the cell and the line in it (the checks see the code cells as one module)
FROM_LINE = re.compile(r" \(from line (\d+)\)")


def from_line(line: int) -> str:
    return f" (from line {line})"


def pointer(expr: ast.AST, origin: Located) -> str:
    """` (from line N)` when the value `expr` reads was made elsewhere (`probs = softmax(x)`
    a few lines up), nothing when its maker is inside `expr` itself."""
    inside = any(n is origin for n in ast.walk(expr))
    return "" if inside else from_line(origin.lineno)


class Severity(str, Enum):
    """How sure and how bad. `--fail-on` compares severities by `rank`."""

    INFO = "info"  # a heuristic: worth a look, often fine
    WARNING = "warning"  # likely to produce inf/NaN in some runs
    ERROR = "error"  # produces inf/NaN whenever the values get there

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def __str__(self) -> str:
        return self.value


_RANKS = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}


@dataclass(frozen=True)
class Finding:
    id: str  # a cause id of SPEC.md
    severity: Severity
    path: str  # as shown to the user: relative to the working directory when inside it
    line: int
    column: int
    end_line: int
    end_column: int
    message: str  # what is wrong here, and what to do, in one breath
    code: str  # the source line `line`, for the caret display
    heuristic: bool = False  # True: a pattern that is often fine (severity info)
    cell: int | None = None  # a notebook's cell (1-based); `line` then counts in the cell
    # a notebook's: (line, column, end_line, end_column) in the .ipynb file itself (SARIF's
    # regions count there), when the file's layout tells
    in_file: tuple[int, int, int, int] | None = None

    @property
    def where(self) -> str:
        """`train.py:9:26` or `notebook.ipynb:cell 3:12:5`."""
        cell = f"cell {self.cell}:" if self.cell is not None else ""
        return f"{self.path}:{cell}{self.line}:{self.column}"


@dataclass(frozen=True)
class Skipped:
    """A file that could not be linted (syntax error, undecodable bytes): reported, never a
    crash, and it fails the run like an error does."""

    path: str
    reason: str
    line: int | None = None
    column: int | None = None
    cell: int | None = None  # a notebook's cell (1-based); `line` then counts in the cell
    in_file: tuple[int, int] | None = None  # a notebook's: (line, column) in the .ipynb file


def syntax_reason(message: str) -> str:
    """A syntax error's reason as a skipped file shows it (Python's own message is often
    just "invalid syntax")."""
    return message if message.startswith("invalid syntax") else f"invalid syntax: {message}"


@dataclass(frozen=True)
class LintResult:
    findings: tuple[Finding, ...]
    skipped: tuple[Skipped, ...]
    files_checked: int
    suppressed: int  # findings silenced by `# nandoctor: ignore[...]` comments

    def counts(self) -> dict[Severity, int]:
        """Findings per severity, every severity present (0 when none), worst first."""
        seen = Counter(f.severity for f in self.findings)
        return {s: seen[s] for s in sorted(Severity, key=lambda s: -s.rank)}

    def fails(self, fail_on: Severity) -> bool:
        """True when the exit code should be 1: a finding at or above `fail_on`, or a file
        that could not be linted."""
        return bool(self.skipped) or any(f.severity.rank >= fail_on.rank for f in self.findings)
