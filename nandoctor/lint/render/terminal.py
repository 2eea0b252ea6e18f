"""The terminal listing: each finding with its code line, a caret and the fix.

    train.py:9:26: error[log-of-softmax] Use `F.log_softmax` (or `F.cross_entropy` ...
        |
      9 | loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()
        |              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
        = fix: Use `F.cross_entropy(logits, target)`, or `F.log_softmax(logits, dim=-1)` ...

    Found 1 problem (1 error) in 1 of 1 file checked.

The code line is shown without its indentation; `--quiet` keeps the first line of each
finding and the summary.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from nandoctor.causes import catalog
from nandoctor.lint.findings import Finding, LintResult, Severity, Skipped

STYLES = {Severity.ERROR: "bold red", Severity.WARNING: "bold yellow", Severity.INFO: "bold cyan"}


def render(console: Console, result: LintResult, *, quiet: bool = False) -> None:
    for finding in result.findings:
        console.print(headline(finding))
        if not quiet:
            console.print(frame(finding))
            console.print()
    for skipped in result.skipped:
        console.print(skipped_line(skipped))
    console.print(summary(result))


def headline(finding: Finding) -> Text:
    text = Text()
    text.append(f"{finding.where}:", style="bold")
    text.append(" ")
    text.append(f"{finding.severity}[{finding.id}]", style=STYLES[finding.severity])
    if finding.heuristic:
        text.append(" (heuristic)", style="dim")
    text.append(f" {finding.message}")
    return text


def frame(finding: Finding) -> Text:
    code = finding.code.rstrip()
    indent = len(code) - len(code.lstrip())
    start = max(finding.column - 1 - indent, 0)
    stop = finding.end_column - 1 - indent if finding.end_line == finding.line else len(code)
    width = len(str(finding.line))
    gutter = " " * (width + 3) + "|"
    text = Text(f"{gutter}\n", style="blue")
    text.append(f"  {finding.line} | ", style="blue")
    text.append(f"{code.lstrip()}\n")
    text.append(gutter, style="blue")
    text.append(" " + " " * start + "^" * max(stop - start, 1), style=STYLES[finding.severity])
    text.append(f"\n{' ' * (width + 3)}= fix: ", style="blue")
    text.append(catalog.get(finding.id).fix)
    return text


def skipped_line(skipped: Skipped) -> Text:
    where = skipped.path
    if skipped.cell is not None:
        where += f":cell {skipped.cell}"
    if skipped.line is not None:
        where += f":{skipped.line}:{skipped.column or 1}"
    text = Text(f"{where}: ", style="bold")
    text.append("error[not-linted]", style=STYLES[Severity.ERROR])
    text.append(f" {skipped.reason}")
    return text


def summary(result: LintResult) -> Text:
    checked = f"{result.files_checked} file{'s' * (result.files_checked != 1)} checked"
    if result.files_checked == 0 and not result.skipped:
        return Text("No Python files or notebooks found.", style="yellow")
    counts = ", ".join(
        f"{n} {s}{'s' * (n != 1 and s is not Severity.INFO)}"  # "2 errors", "2 info"
        for s, n in result.counts().items()
        if n
    )
    files = len({f.path for f in result.findings})
    n = len(result.findings)
    if n:
        line = f"Found {n} problem{'s' * (n != 1)} ({counts}) in {files} of {checked}."
    else:
        line = f"No problems in {checked}."
    if result.suppressed:
        line = line[:-1] + f"; {result.suppressed} suppressed."
    if result.skipped:
        line = line[:-1] + f"; {_not_linted(result.skipped)} could not be linted."
        if not result.files_checked:
            line = f"No file checked: {_not_linted(result.skipped)} could not be linted."
    style = "bold red" if n or result.skipped else "bold green"
    return Text(line, style=style)


def _not_linted(skipped: tuple[Skipped, ...]) -> str:
    """ "2 files", "1 notebook cell", "1 file and 2 notebook cells": a notebook's cell that
    does not parse leaves the rest of its notebook linted."""
    cells = sum(s.cell is not None for s in skipped)
    files = len(skipped) - cells
    parts = [f"{files} file{'s' * (files != 1)}"] if files else []
    if cells:
        parts.append(f"{cells} notebook cell{'s' * (cells != 1)}")
    return " and ".join(parts)
