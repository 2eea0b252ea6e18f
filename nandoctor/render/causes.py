"""The ranked causes for the terminal: confidence, evidence, the fix with its before/after
snippet from the catalog, and whether replaying the fix got the run past its failure."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from nandoctor.causes import catalog
from nandoctor.causes.snippets import for_run
from nandoctor.report.types import Cause

MARKS = {True: "[green]✔ verified[/]", False: "[red]✘ not enough[/]", None: "[dim]not verified[/]"}


def verified_mark(cause: Cause) -> str:
    return MARKS[cause.verified]


def causes_block(
    causes: list[Cause], snippets: int = 1, grad_scaler: bool = True
) -> RenderableType | None:
    """Every cause, best first; the `snippets` best ones with their before/after code
    (without GradScaler lines when the run has no scaler)."""
    if not causes:
        return None
    parts: list[RenderableType] = ["[bold]Why, best first[/]"]
    for rank, cause in enumerate(causes, start=1):
        parts.append(_cause(rank, cause, rank <= snippets, grad_scaler))
    return Group(*parts)


def _cause(rank: int, cause: Cause, with_snippet: bool, grad_scaler: bool) -> RenderableType:
    head = f"[bold]{rank}. {escape(cause.id)}[/] ({cause.confidence:.0%}) {escape(cause.title)}"
    rows: list[RenderableType] = [head]
    rows += [f"   • {escape(line)}" for line in cause.evidence]
    rows.append(f"   [cyan]fix:[/] {escape(cause.fix)}")
    if cause.verified is not None or cause.verification:
        sentence = f": {escape(cause.verification)}" if cause.verification else ""
        rows.append(f"   {verified_mark(cause)}{sentence}")
    if with_snippet:
        rows.append(_snippet(cause.id, grad_scaler))
    return Group(*rows)


def _snippet(cause_id: str, grad_scaler: bool) -> RenderableType:
    info = catalog.get(cause_id)
    grid = Table.grid(padding=(0, 2))
    grid.add_column()
    grid.add_column()
    grid.add_row("[red]before[/]", "[green]after[/]")
    before, after = for_run(info.before, info.after, grad_scaler)
    grid.add_row(_code(before), _code(after))
    return grid


def _code(text: str) -> Syntax:
    return Syntax(text, "python", theme="ansi_dark", word_wrap=True)
