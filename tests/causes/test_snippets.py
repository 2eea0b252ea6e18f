"""A cause's before/after code in the run's terms: no GradScaler lines without a scaler,
and the user's own line edited where the fix is a local edit."""

from __future__ import annotations

import io

from rich.console import Console

from nandoctor.causes import catalog
from nandoctor.causes.snippets import for_run, on_user_line
from nandoctor.render.markdown import render_markdown
from nandoctor.render.terminal import render_report
from nandoctor.report.types import Cause, Environment, FirstNonfinite, Report


def test_a_run_without_a_scaler_gets_the_plain_loop():
    info = catalog.get("exploding-gradients")
    before, after = for_run(info.before, info.after, grad_scaler=False)
    assert before == "loss.backward()\nopt.step()"
    assert after == (
        "loss.backward()\ntorch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "opt.step()"
    )


def test_a_run_with_a_scaler_gets_the_snippet_as_written():
    info = catalog.get("exploding-gradients")
    assert for_run(info.before, info.after, grad_scaler=True) == (info.before, info.after)


def test_snippets_about_the_scaler_itself_stay_as_written():
    for cause in (
        "grad-scaler-collapse",
        "fp16-overflow",
        "clip-before-unscale",
        "fp16-without-grad-scaler",
    ):
        info = catalog.get(cause)
        assert for_run(info.before, info.after, grad_scaler=False) == (info.before, info.after)


def test_a_division_fix_is_written_on_the_users_own_line():
    assert on_user_line("division-by-zero", "    y = (x - m) / x.std(0)") == (
        "y = (x - m) / x.std(0)",
        "y = (x - m) / x.std(0).clamp_min(1e-6)",
    )
    assert on_user_line("division-by-zero", "loss = a.sum() / mask.sum()  # mean") == (
        "loss = a.sum() / mask.sum()",
        "loss = a.sum() / mask.sum().clamp_min(1)",
    )


def test_no_own_line_fix_when_it_is_already_bounded_or_not_a_reduction():
    assert on_user_line("division-by-zero", "z = x / x.std(0).clamp_min(1e-3)") is None
    assert on_user_line("division-by-zero", "q = a / b") is None
    assert on_user_line("log-of-softmax", "y = x / x.std(0)") is None


def test_the_report_shows_the_fix_on_the_users_line(tmp_path):
    source = tmp_path / "train.py"
    source.write_text("import torch\n\n\ndef norm(x):\n    return (x - x.mean(0)) / x.std(0)\n")
    report = Report(
        "diagnose",
        "run.yaml",
        Environment("cpu", "2", "float32", False, 1),
        "nonfinite",
        3,
        summary="step 3, phase forward: div produced NaN",
        first_nonfinite=FirstNonfinite(3, "forward", op="div", source=f"{source}:5"),
        causes=[Cause("division-by-zero", "0/0 or x/0 in user math", 0.85)],
    )
    console = Console(record=True, width=200, file=io.StringIO())
    render_report(console, report)
    text = console.export_text()
    assert "return (x - x.mean(0)) / x.std(0).clamp_min(1e-6)" in text
    assert "unit = F.normalize" not in text  # the catalog's generic example gives way
    assert "x.std(0).clamp_min(1e-6)" in render_markdown(report)
