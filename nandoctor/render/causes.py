"""The ranked causes for the terminal: confidence, evidence, the fix with its before/after
snippet from the catalog, and whether replaying the fix got the run past its failure."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.syntax import Syntax
from rich.table import Table

from nandoctor.causes import catalog
from nandoctor.causes.snippets import for_run, on_user_line
from nandoctor.report.types import Cause

MARKS = {True: "[green]✔ verified[/]", False: "[red]✘ not enough[/]", None: "[dim]not verified[/]"}


def verified_mark(cause: Cause) -> str:
    return MARKS[cause.verified]


def causes_block(
    causes: list[Cause], snippets: int = 1, grad_scaler: bool = True, line: str | None = None
) -> RenderableType | None:
    """Every cause, best first; the `snippets` best ones with their before/after code:
    on the user's own `line` where the fix is an edit of it, else the catalog's (without
    GradScaler lines when the run has no scaler)."""
    if not causes:
        return None
    parts: list[RenderableType] = ["[bold]Why, best first[/]"]
    for rank, cause in enumerate(causes, start=1):
        parts.append(_cause(rank, cause, rank <= snippets, grad_scaler, line))
    return Group(*parts)


def _cause(
    rank: int, cause: Cause, with_snippet: bool, grad_scaler: bool, line: str | None
) -> RenderableType:
    head = f"[bold]{rank}. {escape(cause.id)}[/] ({cause.confidence:.0%}) {escape(cause.title)}"
    rows: list[RenderableType] = [head]
    rows += [f"   • {escape(line)}" for line in cause.evidence]
    rows.append(f"   [cyan]fix:[/] {escape(cause.fix)}")
    if cause.verified is not None or cause.verification:
        sentence = f": {escape(cause.verification)}" if cause.verification else ""
        rows.append(f"   {verified_mark(cause)}{sentence}")
    if with_snippet:
        rows.append(_snippet(cause.id, grad_scaler, line))
    return Group(*rows)


def snippet_pair(cause_id: str, grad_scaler: bool, line: str | None) -> tuple[str, str]:
    """The before/after to show: the user's line edited, or the catalog's pair."""
    own = on_user_line(cause_id, line) if line else None
    if own is not None:
        return own
    info = catalog.get(cause_id)
    return for_run(info.before, info.after, grad_scaler)


def _snippet(cause_id: str, grad_scaler: bool, line: str | None) -> RenderableType:
    grid = Table.grid(padding=(0, 2))
    grid.add_column()
    grid.add_column()
    grid.add_row("[red]before[/]", "[green]after[/]")
    before, after = snippet_pair(cause_id, grad_scaler, line)
    grid.add_row(_code(before), _code(after))
    return grid


def _code(text: str) -> Syntax:
    return Syntax(text, "python", theme="ansi_dark", word_wrap=True)
