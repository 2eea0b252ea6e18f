"""`lint_paths`: read the files, run the selected checks, apply suppressions, sort.

    >>> result = lint_paths(["train.py"], LintConfig())
    >>> [(f.line, f.id) for f in result.findings]
    [(9, 'log-of-softmax'), (12, 'exploding-gradients')]

A file that does not decode or parse becomes a `Skipped` entry with the line of the error;
a check that raises on some odd file becomes one too (naming the check), never a crash.
Files that never mention torch are read but not checked: the checks speak torch only.
A notebook's code cells are linted as one module (`lint.notebook`), each finding placed
back in its cell (`notebook.ipynb:cell 3:12:5`).
"""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nandoctor.lint.config import LintConfig
from nandoctor.lint.files import discover, display_path
from nandoctor.lint.findings import FROM_LINE, Finding, LintResult, Skipped, syntax_reason
from nandoctor.lint.notebook import (
    CellError,
    Notebook,
    NotebookError,
    is_notebook,
    read_notebook,
)
from nandoctor.lint.registry import all_checks
from nandoctor.lint.source import Source
from nandoctor.lint.suppress import parse_suppressions
from nandoctor.lint.unit import Check, Spot


@dataclass(frozen=True)
class FileOutcome:
    findings: tuple[Finding, ...] = ()
    suppressed: int = 0
    skipped: tuple[Skipped, ...] = ()
    checked: bool = True  # False: the file could not be read or parsed at all


def lint_paths(paths: Sequence[str | Path], config: LintConfig | None = None) -> LintResult:
    config = config or LintConfig()
    files = discover(paths, config.exclude, config.root)
    outcomes = [lint_file(path, config) for path in files]
    findings = sorted(
        (f for o in outcomes for f in o.findings),
        key=lambda f: (f.path, f.cell or 0, f.line, f.column, f.id),
    )
    return LintResult(
        findings=tuple(findings),
        skipped=tuple(s for o in outcomes for s in o.skipped),
        files_checked=sum(o.checked for o in outcomes),
        suppressed=sum(o.suppressed for o in outcomes),
    )


def lint_file(path: Path, config: LintConfig) -> FileOutcome:
    shown = display_path(path)
    if is_notebook(path):
        return lint_notebook(path, shown, config)
    try:
        text = _read(path)
    except UnicodeDecodeError as e:
        return _not_checked(_undecodable(shown, e))
    except (OSError, SyntaxError) as e:
        return _not_checked(Skipped(shown, f"cannot read: {e}"))
    return lint_text(text, shown, config)


def lint_text(text: str, path: str = "<string>", config: LintConfig | None = None) -> FileOutcome:
    """Lint one file's text; `path` is only what findings show."""
    config = config or LintConfig()
    if (nul := text.find("\0")) >= 0:  # NB: `ast` names no line for it
        line, column = text.count("\n", 0, nul) + 1, nul - text.rfind("\n", 0, nul)
        return _not_checked(Skipped(path, "a NUL byte: not Python source", line, column))
    try:
        src = Source(path, text)
    except SyntaxError as e:
        return _not_checked(Skipped(path, syntax_reason(e.msg), e.lineno, e.offset))
    except (ValueError, RecursionError, MemoryError) as e:
        return _not_checked(Skipped(path, f"cannot parse: {e}"))
    if not src.imports_torch:
        return FileOutcome()
    return _run_checks(src, config)


def lint_notebook(path: Path, shown: str, config: LintConfig) -> FileOutcome:
    """The code cells as one module; each finding and syntax error placed in its cell."""
    try:
        notebook = read_notebook(path)
    except (OSError, NotebookError) as e:
        return _not_checked(Skipped(shown, f"cannot read: {e}"))
    outcome = lint_text(notebook.text, shown, config)
    broken = tuple(_broken_cell(shown, e, notebook) for e in notebook.errors)
    return FileOutcome(
        findings=tuple(_in_cell(f, notebook) for f in outcome.findings),
        suppressed=outcome.suppressed,
        skipped=broken + tuple(_skipped_in_cell(s, notebook) for s in outcome.skipped),
    )


def _not_checked(skipped: Skipped) -> FileOutcome:
    return FileOutcome(skipped=(skipped,), checked=False)


def _undecodable(shown: str, e: UnicodeDecodeError) -> Skipped:
    """Where the first byte that does not decode is, by line and column, as Python says it."""
    data = e.object if isinstance(e.object, bytes) else bytes(e.object)
    line = data.count(b"\n", 0, e.start) + 1
    column = e.start - data.rfind(b"\n", 0, e.start)
    reason = (
        f"cannot read: byte 0x{data[e.start]:02x} is not {e.encoding} ({e.reason}); "
        "declare the file's encoding in a `# -*- coding: ... -*-` line"
    )
    return Skipped(shown, reason, line, column)


def _in_cell(finding: Finding, notebook: Notebook) -> Finding:
    cell, line = notebook.where(finding.line)
    end_cell, end_line = notebook.where(finding.end_line)

    def from_cell(match: re.Match[str]) -> str:
        origin_cell, origin_line = notebook.where(int(match[1]))
        where = "" if origin_cell == cell else f"cell {origin_cell}, "
        return f" (from {where}line {origin_line})"

    # NB: columns as the cell is written (an indented cell was linted dedented)
    column = notebook.column(finding.line, finding.column)
    end_column = notebook.column(finding.end_line, finding.end_column)
    end = (finding.end_line, end_column) if end_cell == cell else (finding.line, 10**9)
    start_in_file = notebook.in_file(finding.line, column)
    end_in_file = notebook.in_file(*end)
    return dataclasses.replace(
        finding,
        cell=cell,
        line=line,
        column=column,
        end_column=end_column if end_cell == cell else finding.end_column,
        end_line=end_line if end_cell == cell else line,
        code=notebook.original(finding.line),
        message=FROM_LINE.sub(from_cell, finding.message),
        in_file=(*start_in_file, *end_in_file) if start_in_file and end_in_file else None,
    )


def _skipped_in_cell(skipped: Skipped, notebook: Notebook) -> Skipped:
    if skipped.line is None:
        return skipped
    cell, line = notebook.where(skipped.line)
    in_file = notebook.in_file(skipped.line, skipped.column or 1)
    return dataclasses.replace(skipped, cell=cell, line=line, in_file=in_file)


def _broken_cell(shown: str, error: CellError, notebook: Notebook) -> Skipped:
    """A cell left out of the notebook's module: it does not parse on its own."""
    first = notebook.cells.index(error.cell) + 1  # its first line in the module
    line = first + min(error.line or 1, notebook.cells.count(error.cell)) - 1
    in_file = notebook.in_file(line, error.column or 1)
    return Skipped(shown, error.message, error.line, error.column, error.cell, in_file)


def _run_checks(src: Source, config: LintConfig) -> FileOutcome:
    suppressions = parse_suppressions(src.text)
    findings: dict[tuple[str, int, int], Finding] = {}
    suppressed, skipped = 0, []
    for check in all_checks().values():
        if not config.enabled(check.id):
            continue
        try:
            hits = list(check.run(src))
        except Exception as e:  # NB: a bug of ours must not hide the other checks' findings
            skipped.append(Skipped(src.path, f"check {check.id} failed ({type(e).__name__}: {e})"))
            continue
        for hit in hits:
            finding = _finding(src, check, hit, config)
            first, last = src.statement_lines(hit.node)
            lines = (min(first, finding.line), max(last, finding.end_line))
            if suppressions.covers(check.id, *lines):
                suppressed += 1
            else:
                findings.setdefault((finding.id, finding.line, finding.column), finding)
    ordered = sorted(findings.values(), key=lambda f: (f.line, f.column, f.id))
    return FileOutcome(tuple(ordered), suppressed, tuple(skipped))


def _finding(src: Source, check: Check, hit: Spot, config: LintConfig) -> Finding:
    span = src.span(hit.node)
    return Finding(
        id=check.id,
        severity=config.severity_of(check.id, hit.severity or check.severity),
        path=src.path,
        line=span.line,
        column=span.column,
        end_line=span.end_line,
        end_column=span.end_column,
        message=hit.message,
        code=src.line_text(span.line),
        heuristic=check.heuristic,
    )


def _read(path: Path) -> str:
    """Decode as Python does: a coding cookie or BOM, else UTF-8."""
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:
        # NB: its "invalid or missing encoding declaration" names no line: the bytes that
        # are no UTF-8 do (`_undecodable`), unless a cookie names an unknown encoding
        data.decode("utf-8")
        raise
    return data.decode(encoding)
