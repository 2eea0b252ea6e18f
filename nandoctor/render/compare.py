"""`compare` in the terminal: one column per dtype, the verdict, the loss curves overlaid."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from nandoctor.render.textplot import overlay
from nandoctor.report.comparison import CompareRun, Comparison

MARKERS = {"float16": "h", "bfloat16": "b", "float32": "f"}


def render_comparison(console: Console, comparison: Comparison, quiet: bool = False) -> None:
    if quiet:
        state = comparison.status.upper()
        console.print(escape(f"nandoctor compare {comparison.config}: {state}"), soft_wrap=True)
        console.print(escape(f"  {comparison.verdict}"), soft_wrap=True)
        return
    parts: list[RenderableType] = [comparison_table(comparison), "", _plot(comparison)]
    parts += [f"[dim]note: {escape(n)}[/]" for n in comparison.notes]
    style = "green" if comparison.healthy else "red"
    console.print(
        Panel(Group(*parts), title="nandoctor compare", title_align="left", border_style=style)
    )
    console.print(
        Panel(escape(comparison.verdict), title="verdict", title_align="left", border_style=style)
    )


def comparison_table(comparison: Comparison) -> Table:
    table = Table(show_edge=False)
    table.add_column("")
    for run in comparison.runs:
        scaler = " + GradScaler" if run.grad_scaler else ""
        table.add_column(escape(f"{run.dtype}{scaler}"), justify="right")
    rows = {
        "status": lambda r: _status(r),
        "clean steps": lambda r: str(r.steps_completed),
        "first non-finite": _first,
        "final loss": lambda r: _num(r.final_loss),
        f"max |Δloss| vs {comparison.reference or 'float32'}": lambda r: _num(
            r.max_abs_loss_diff_vs_reference
        ),
        "median step": lambda r: f"{r.step_time_ms:.1f} ms" if r.step_time_ms is not None else "-",
        "fp16 headroom": _headroom,
    }
    for label, cell in rows.items():
        table.add_row(label, *(cell(run) for run in comparison.runs))
    return table


def _status(run: CompareRun) -> str:
    return {"healthy": "[green]healthy[/]", "nonfinite": "[red]NON-FINITE[/]"}.get(
        run.status, run.status
    )


def _first(run: CompareRun) -> str:
    if run.first_nonfinite_step is None:
        return "-"
    return f"step {run.first_nonfinite_step} ({run.first_nonfinite_phase})"


def _headroom(run: CompareRun) -> str:
    """Only where the dtype can overflow: bfloat16 and float32 reach 3.4e38."""
    if not run.headroom or run.dtype != "float16":
        return "-"
    if run.nonfinite_module is not None:
        broke = run.nonfinite_module or "(root)"
        return escape(f"non-finite in {broke} at step {run.first_nonfinite_step}")
    h = run.headroom[0]
    return escape(f"{min(h.peak_fraction, 1.0):.0%} in {h.module or '(root)'}")


def _plot(comparison: Comparison) -> str:
    # NB: drawn last, the config's own dtype (the first run) stays visible where curves meet
    series = {r.dtype: (r.telemetry.step, r.telemetry.loss) for r in reversed(comparison.runs)}
    markers = {d: MARKERS.get(d, d[0]) for d in series}
    lines = overlay(series, markers)
    legend = "   ".join(f"{markers[r.dtype]} {r.dtype}" for r in comparison.runs)
    legend += "   × non-finite"
    return escape("\n".join(["loss", *lines, legend]))


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"
