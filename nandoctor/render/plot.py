"""`compare --plot PATH`: loss and gradient norm per dtype as a PNG (matplotlib, optional)."""

from __future__ import annotations

import io
import textwrap
from typing import Any

from nandoctor.errors import UsageError
from nandoctor.report.comparison import Comparison


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


def plot_png(comparison: Comparison) -> bytes:
    plt = require_matplotlib()
    fig, (loss_ax, grad_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for run in comparison.runs:
        t = run.telemetry
        loss_ax.plot(t.step, t.loss, label=run.dtype)
        grad_ax.plot(t.step, t.grad_norm, label=run.dtype)
        if run.first_nonfinite_step is not None:
            loss_ax.axvline(run.first_nonfinite_step, linestyle=":", alpha=0.6)
    loss_ax.set_ylabel("loss")
    grad_ax.set_ylabel("gradient norm (unscaled)")
    grad_ax.set_yscale("log")
    grad_ax.set_xlabel("step")
    loss_ax.legend()
    loss_ax.set_title(textwrap.fill(comparison.verdict, 110), fontsize=7, loc="left")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()
