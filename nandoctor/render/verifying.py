"""The terminal while the fixes replay: where and why first, as soon as the bad step is
located, then each fix's replay as it runs; the verdicts follow in the report's panel.

    ╭─ NON-FINITE at step 1031 · phase loss · verifying the fixes ─────╮
    │ step 1031, phase loss: the loss was non-finite                   │
    │ Why, best first                                                  │
    │ 1. learning-rate-too-high (80%) ...                              │
    ╰──────────────────────────────────────────────────────────────────╯
    verifying learning-rate-too-high: with a 10x smaller learning rate (...), steps 1024 to 1063

On a terminal the replay's line is a live bar over its steps (gone once the report
prints); elsewhere (a CI log, a pipe) a plain line per replay, without times, so that
the same run logs the same lines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from nandoctor.render.causes import causes_block
from nandoctor.render.origin import origin_block, source_line
from nandoctor.report.types import Report

if TYPE_CHECKING:
    from nandoctor.diagnose.rewind import Replaying
    from nandoctor.runtime.verdict import Verdict


def located_panel(report: Report) -> Panel:
    """Where the run failed and its causes, best first by the rules, before any fix is
    replayed (no verdicts, no snippets: the report's panel has them)."""
    body: list = [escape(report.summary)]
    where = origin_block(report)
    if where is not None:
        body.append(where)
    first = report.first_nonfinite
    own = source_line(first.source) if first is not None else None
    why = causes_block(
        report.causes, snippets=0, grad_scaler=report.environment.grad_scaler, line=own
    )
    if why is not None:
        body.append(why)
    at = f"at step {first.step} · phase {first.phase} " if first is not None else ""
    title = f"[bold red]NON-FINITE {at}[/]· verifying the fixes"
    return Panel(Group(*body), title=title, title_align="left", border_style="red")


def replay_line(replay: Replaying) -> str:
    resumed = " (resumed from a snapshot)" if replay.resumed else ""
    steps = f"steps {replay.start} to {replay.target}{resumed}"
    return f"verifying {replay.cause}: {replay.describe}, {steps}"


class FixProgress:
    """The where-and-why panel, then a line per fix replayed: a live bar on a terminal,
    plain lines elsewhere; nothing when quiet."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console, self.enabled = console, enabled
        self._live = enabled and console.is_terminal
        # NB: the sentence cut short to the terminal's width, the bar and the counts kept
        line = Column(ratio=1, no_wrap=True, overflow="ellipsis")
        self._progress = Progress(
            TextColumn("{task.description}", table_column=line),
            BarColumn(bar_width=24),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            expand=True,
        )
        self._task = self._progress.add_task("", total=None, visible=False)

    def located(self, report: Report) -> None:
        if self.enabled:
            self.console.print(located_panel(report))

    def replay(self, replay: Replaying) -> None:
        if not self.enabled:
            return
        if not self._live:
            self.console.print(escape(replay_line(replay)), soft_wrap=True)
            return
        self._progress.start()
        total = replay.target - replay.start + 1
        snapshot = " (snapshot)" if replay.resumed else ""
        line = f"verifying {replay.cause} from step {replay.start}{snapshot}: {replay.describe}"
        self._progress.reset(self._task, total=total, description=escape(line), visible=True)

    def step(self, verdict: Verdict) -> None:
        if self._live and self.enabled:
            self._progress.advance(self._task)

    def stop(self) -> None:
        if self._live and self.enabled:
            self._progress.stop()
