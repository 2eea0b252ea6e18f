"""`compare --plot PATH`: loss, gradient norm, the difference from float32 and float16's
loss scale per dtype, as a PNG (matplotlib, optional)."""

from __future__ import annotations

import io
import math
import textwrap
from typing import Any

from nandoctor.errors import UsageError
from nandoctor.report.comparison import CompareRun, Comparison


def require_matplotlib() -> Any:
    """Fail before the runs, not after them, when the optional extra is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib, which is not installed",
            hint="pip install 'nandoctor[plot]'",
        ) from None
    return plt


# Okabe-Ito: distinguishable with every common colour-vision deficiency
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#D55E00", "#56B4E9"]
STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ("-", "v"), ("--", "x")]


def plot_png(comparison: Comparison) -> bytes:
    plt = require_matplotlib()
    fig = figure(comparison)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def figure(comparison: Comparison) -> Any:
    """Loss (log scale), the gradient norm, each dtype's loss difference from float32, and
    float16's loss scale; each dtype its own colour, line style and markers, so overlapping
    curves stay apart; a labelled marker where a run went non-finite."""
    plt = require_matplotlib()
    runs = comparison.runs
    reference = next((r for r in runs if r.dtype == "float32"), None)
    scaled = [
        r for r in runs if r.dtype == "float16" and any(s is not None for s in r.telemetry.scale)
    ]
    panels = ["loss", "grad"] + (["diff"] if reference and len(runs) > 1 else [])
    panels += ["scale"] if scaled else []
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True)
    ax = dict(zip(panels, axes, strict=True))
    for i, run in enumerate(runs):
        colour, (line, marker) = PALETTE[i % len(PALETTE)], STYLES[i % len(STYLES)]
        style: dict[str, Any] = {"color": colour, "linestyle": line, "marker": marker}
        style["label"] = run.dtype
        style["markevery"] = max(1, len(run.telemetry.step) // 12)
        style["markersize"] = 4
        t = run.telemetry
        ax["loss"].plot(t.step, _positive(t.loss), **style)
        ax["grad"].plot(t.step, _positive(t.grad_norm), **style)
        if "diff" in ax and reference is not None and run is not reference:
            steps, diffs = _difference(run, reference)
            ax["diff"].plot(steps, diffs, **style)
        if run in scaled:
            ax["scale"].plot(
                t.step, [s if s is not None else float("nan") for s in t.scale], **style
            )
        _mark_failure(ax["loss"], run, colour)
    ax["loss"].set_ylabel("loss")
    ax["loss"].set_yscale("log")
    ax["grad"].set_ylabel("gradient norm\n(unscaled)")
    ax["grad"].set_yscale("log")
    if "diff" in ax:
        ax["diff"].set_ylabel("|loss - float32 loss|")
        ax["diff"].set_yscale("log")
    if "scale" in ax:
        ax["scale"].set_ylabel("loss scale")
        ax["scale"].set_yscale("log", base=2)
    axes[-1].set_xlabel("step")
    ax["loss"].legend(fontsize=8)
    ax["loss"].set_title(textwrap.fill(comparison.verdict, 110), fontsize=7, loc="left")
    return fig


def _positive(values: list[float]) -> list[float]:
    """A log axis shows positive finite values; the rest are gaps."""
    return [v if v is not None and math.isfinite(v) and v > 0 else float("nan") for v in values]


def _difference(run: CompareRun, reference: CompareRun) -> tuple[list[int], list[float]]:
    """|loss - float32's loss| at the steps where both are finite."""
    ref = dict(zip(reference.telemetry.step, reference.telemetry.loss, strict=False))
    steps, diffs = [], []
    for step, loss in zip(run.telemetry.step, run.telemetry.loss, strict=False):
        other = ref.get(step)
        if other is not None and math.isfinite(loss) and math.isfinite(other):
            steps.append(step)
            diffs.append(abs(loss - other) or float("nan"))
    return steps, diffs


def _mark_failure(ax: Any, run: CompareRun, colour: str) -> None:
    step = run.first_nonfinite_step
    if step is None:
        return
    ax.axvline(step, color=colour, linestyle=":", alpha=0.8)
    phase = f", {run.first_nonfinite_phase}" if run.first_nonfinite_phase else ""
    ax.annotate(
        f"{run.dtype}: non-finite at step {step}{phase}",
        xy=(step, 0.95),
        xycoords=("data", "axes fraction"),
        rotation=90,
        va="top",
        ha="right",
        fontsize=7,
        color=colour,
    )
