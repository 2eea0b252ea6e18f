"""`compare` in the terminal: the quiet line says what ended the comparison."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from nandoctor.render.compare import render_comparison
from nandoctor.report.comparison import CompareEnvironment, CompareRun, Comparison


def comparison_of(*runs: tuple[str, str, int | None]) -> Comparison:
    """A comparison of (dtype, status, first non-finite step) runs, 7 clean steps each."""
    return Comparison(
        "c.yaml",
        CompareEnvironment("cpu", "2.13", 2),
        [
            CompareRun(dtype, False, status, 7, first, "loss" if first else None, 1.0, None, None)
            for dtype, status, first in runs
        ],
        "verdict",
    )


@pytest.mark.parametrize(
    ("statuses", "state"),
    [
        (("healthy", "healthy"), "HEALTHY"),
        (("nonfinite", "healthy"), "NONFINITE"),
        (("healthy", "interrupted"), "INTERRUPTED"),  # nothing went non-finite
        (("nonfinite", "interrupted"), "INTERRUPTED"),  # as the exit code (130) says
    ],
)
def test_the_quiet_line_names_what_ended_the_comparison(statuses, state):
    runs = [
        (dtype, status, 7 if status == "nonfinite" else None)
        for dtype, status in zip(("float16", "bfloat16"), statuses, strict=True)
    ]
    out = io.StringIO()
    render_comparison(Console(file=out, width=100), comparison_of(*runs), quiet=True)
    assert out.getvalue().splitlines()[0] == f"nandoctor compare c.yaml: {state}"
