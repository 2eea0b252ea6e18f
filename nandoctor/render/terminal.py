"""The terminal: a header, a live progress bar, and the verdict panel.

    ╭─ nandoctor diagnose ─────────────────────────────────────────────╮
    │ config  configs/seed-fp16-nan.yaml (seed-fp16-nan)               │
    │ run     cpu · float16 autocast · GradScaler (init scale 65536)   │
    ╰──────────────────────────────────────────────────────────────────╯
    ╭─ NON-FINITE at step 116 · phase loss ────────────────────────────╮
    │ step 116, phase loss: the loss was non-finite                    │
    │ loss       ▇▆▅▄▄▃▃▂▂▂▂▁▁▁▁×   2.31 → nan                         │
    │ grad norm  ▂▃▃▄▃▄▄▅▄▅▅▆▆▅▇×   0.74 → nan                         │
    ╰──────────────────────────────────────────────────────────────────╯

`render_report` reads only the report; the header and progress read the live session.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from nandoctor.render.causes import causes_block
from nandoctor.render.forecast import fix_of
from nandoctor.render.origin import origin_block, source_line
from nandoctor.render.sparkline import column, sparkline
from nandoctor.report.divergence import divergence_text, divergences, fails_by_divergence
from nandoctor.report.forecast import fails_by_forecast, forecast_text, num, plural, where_text
from nandoctor.report.telemetry import skips_text
from nandoctor.report.types import Report

if TYPE_CHECKING:
    from nandoctor.runtime.verdict import Verdict
    from nandoctor.setup.session import Session


def print_header(console: Console, command: str, config_path: str, session: Session) -> None:
    cfg = session.config
    grid = Table.grid(padding=(0, 2))
    grid.add_row("config", escape(f"{config_path}" + (f" ({cfg.name})" if cfg.name else "")))
    grid.add_row("run", escape(describe_run(session)))
    console.print(Panel(grid, title=f"nandoctor {command}", title_align="left", expand=False))


def describe_run(session: Session) -> str:
    dtype = str(session.dtype).removeprefix("torch.")
    parts = [str(session.device), f"{dtype} autocast" if dtype != "float32" else "float32"]
    if session.emulates_cuda_autocast:  # NB: the CPU computes what a CUDA job would
        parts[-1] += " (CUDA's lists)"
    if session.scaler is not None:
        parts.append(f"GradScaler (init scale {session.scaler.get_scale():g})")
    clip = session.config.clip_grad_norm
    parts.append(f"clip_grad_norm {clip:g}" if clip is not None else "no clipping")
    parts.append(f"{session.config.steps} steps")
    if session.start_step:
        parts.append(f"from step {session.start_step}")
    return " · ".join(parts)


class StepProgress:
    """A progress bar over steps showing the live loss, the time so far and the time left;
    a no-op when quiet."""

    def __init__(self, console: Console, total: int, enabled: bool = True) -> None:
        self.enabled = enabled and console.is_terminal
        self._progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),  # NB: from the mean step time so far
            console=console,
            transient=True,
        )
        self._task = self._progress.add_task("replay", total=total, loss="-")

    def __enter__(self) -> StepProgress:
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._progress.stop()

    def update(self, verdict: Verdict) -> None:
        if self.enabled:
            self._progress.update(self._task, advance=1, loss=f"{verdict.reading.loss:.4g}")


def render_report(
    console: Console,
    report: Report,
    quiet: bool = False,
    command: str | None = None,
    divergence_fails: bool = False,
    forecast_fails: bool = False,
) -> None:
    """The report's panel (or its quiet lines); `command`: the one that ran, where it is
    not the report's own (`baseline` runs a diagnose). `divergence_fails`: the run was
    asked to fail on a divergence (`--fail-on-divergence`): a finite run that diverged
    is then headed as the failure its exit code says it is, not as healthy. A forecast
    gets a FORECAST panel of its own, below (red with `--fail-on-forecast`)."""
    if quiet:
        for line in quiet_lines(report, command, divergence_fails, forecast_fails):
            console.print(escape(line), soft_wrap=True)
        return
    style = {"healthy": "green", "nonfinite": "red"}.get(report.status, "yellow")
    if (report.gate is not None and not report.gate.passed) or fails_by_divergence(
        report.status, report.events, divergence_fails
    ):
        style = "red"
    body: list = [escape(report.summary)]
    where = origin_block(report)
    if where is not None:
        body.append(where)
    first = report.first_nonfinite
    own = source_line(first.source) if first is not None else None
    why = causes_block(report.causes, grad_scaler=report.environment.grad_scaler, line=own)
    if why is not None:
        body.append(why)
    if report.ranks:
        body.append(escape("ranks: " + " · ".join(f"{r.rank} {r.status}" for r in report.ranks)))
    if report.gate is not None:
        body.append(_gate(report))
    if report.telemetry.step:
        body.append(_curves(report))
    skips = skips_text(report.events)
    if skips is not None:
        body.append(f"[dim]{skips}[/]")
    for note in report.notes:
        body.append(f"[dim]note: {escape(note)}[/]")
    title = _title(report, divergence_fails)
    console.print(Panel(Group(*body), title=title, title_align="left", border_style=style))
    forecast = forecast_panel(report, forecast_fails)
    if forecast is not None:
        console.print(forecast)


def forecast_panel(report: Report, forecast_fails: bool = False) -> Panel | None:
    """The FORECAST panel: each failure seen coming (best first), how long before the
    failure it came when the run failed, and its cause's fix."""
    if not report.forecast:
        return None
    first = report.first_nonfinite
    body: list = []
    for f in report.forecast:
        lead = f", {first.step - f.step} steps before the failure" if first is not None else ""
        due = f"in about {plural(f.eta_steps)} (step {f.due})"
        seen = f"seen at step {f.step}{lead} · {f.confidence:.0%}"
        body.append(f"[bold]{escape(f.kind)}[/] {due} · {seen}")
        where = where_text(f).removeprefix(", ") or "the run"
        op = f", {f.op}" if f.op else ""
        body.append(escape(f"{where}{op}: {f.metric} {num(f.value)} of {num(f.limit)}; {f.why}"))
        fix = fix_of(f.kind)
        if fix:
            body.append(f"[dim]fix: {escape(fix)}[/]")
    failing = fails_by_forecast(report.forecast, forecast_fails)
    head = "FORECAST" + (" (--fail-on-forecast)" if failing else "")
    style = "red" if failing else "yellow"
    title = f"[bold {style}]{head}[/]"
    return Panel(Group(*body), title=title, title_align="left", border_style=style)


def quiet_lines(
    report: Report,
    command: str | None = None,
    divergence_fails: bool = False,
    forecast_fails: bool = False,
) -> list[str]:
    """A handful of lines that read well in a CI log."""
    env = report.environment
    state = report.status.upper()
    if report.gate is not None and not report.gate.passed:
        state += ", HEALTH CHECK FAILED"
    if fails_by_divergence(report.status, report.events, divergence_fails):
        state += ", DIVERGED"
    if fails_by_forecast(report.forecast, forecast_fails):
        state += ", FORECAST"
    lines = [f"nandoctor {command or report.command} {report.config}: {state}"]
    lines.append(f"  {report.summary}")
    if report.causes:
        top = report.causes[0]
        verified = {True: ", fix verified", False: ", fix not enough alone", None: ""}[top.verified]
        lines.append(f"  top cause: {top.id} ({top.confidence:.0%}{verified}): {top.fix}")
    if report.gate is not None:
        lines += [
            f"  {'ok  ' if c.passed else 'FAIL'} {c.name}: {c.message}" for c in report.gate.checks
        ]
    scaler = f"grad_scaler={env.grad_scaler}"
    skips = skips_text(report.events)
    if skips is not None:  # NB: a healthy fp16 run's skips say whether they were rechecked
        scaler += f" ({skips})"
    lines += [f"  {divergence_text(e)}" for e in divergences(report.events)]
    lines += [f"  forecast: {forecast_text(f)}" for f in report.forecast[:3]]
    lines.append(f"  {env.device} {env.dtype} {scaler} threads={env.threads}")
    return lines


def _gate(report: Report) -> Table:
    """The numeric-health checks: headroom, and the baseline's, each passed or failed."""
    assert report.gate is not None
    grid = Table.grid(padding=(0, 2))
    source = f" against {report.gate.baseline}" if report.gate.baseline else ""
    grid.add_row(f"[bold]numeric health{escape(source)}[/]", "")
    for check in report.gate.checks:
        mark = "[green]✔[/]" if check.passed else "[red]✘[/]"
        grid.add_row(f"{mark} {escape(check.name)}", escape(check.message))
    return grid


def _title(report: Report, divergence_fails: bool = False) -> str:
    first = report.first_nonfinite
    if first is not None:
        return f"[bold red]NON-FINITE at step {first.step} · phase {first.phase}[/]"
    if report.gate is not None and not report.gate.passed:
        return "[bold red]HEALTH CHECK FAILED[/] (every step finite)"
    if fails_by_divergence(report.status, report.events, divergence_fails):
        step = min(e.step for e in divergences(report.events))
        return f"[bold red]DIVERGED at step {step}[/] (every step finite)"
    if report.status == "healthy":
        return "[bold green]HEALTHY[/]"
    return f"[bold yellow]{report.status.upper()}[/]"


def _curves(report: Report) -> Group:
    """One labelled row per curve, a caret under a curve where it diverged, and what the
    divergence was below them (NB: not beside: a long line there squeezed the labels out
    of an 80-column panel)."""
    t = report.telemetry
    scaled = any(s is not None for s in t.scale)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, min_width=max(map(len, _LABELS[: 2 + scaled])))
    grid.add_column(no_wrap=True, min_width=_WIDTH)
    grid.add_column(no_wrap=True, overflow="ellipsis")
    grid.add_row(_LABELS[0], sparkline(t.loss, _WIDTH), _ends(t.loss))
    _mark_divergence(grid, report, "loss")
    # NB: from the first finite norm: a GradScaler's skipped steps (its first calibration)
    # have non-finite scaled gradients, which are no NaN of the run's
    grads = _ends(t.grad_norm, from_finite=True)
    grid.add_row(_LABELS[1], sparkline(t.grad_norm, _WIDTH, log=True), grads)
    _mark_divergence(grid, report, "grad_norm")
    if scaled:
        grid.add_row(_LABELS[2], sparkline(t.scale, _WIDTH, log=True), _ends(t.scale))
    said = [f"[magenta]^ {escape(divergence_text(e))}[/]" for e in _marked(report)]
    return Group(grid, *said)


_LABELS = ("loss", "grad norm", "loss scale")


def _marked(report: Report) -> list:
    """The divergences with a step on the curves."""
    return [e for e in divergences(report.events) if e.step in report.telemetry.step]


def _mark_divergence(grid: Table, report: Report, metric: str) -> None:
    """A caret under the curve at the step where the metric diverged."""
    for event in _marked(report):
        if event.metric != metric:
            continue
        steps = report.telemetry.step
        at = column(steps.index(event.step), len(steps), _WIDTH)
        grid.add_row("", "[bold magenta]" + " " * at + "^[/]", "")


_WIDTH = 40  # sparkline columns: fits an 80-column terminal beside the labels


def _ends(values: Sequence[float | None], from_finite: bool = False) -> str:
    def fmt(v: float | None) -> str:
        return "-" if v is None else (f"{v:.4g}" if math.isfinite(v) else str(v))

    finite = [v for v in values if v is not None and math.isfinite(v)]
    first = finite[0] if from_finite and finite else values[0]
    return f"{fmt(first)} → {fmt(values[-1])}"
