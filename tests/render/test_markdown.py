"""The Markdown report states the same facts as the JSON one."""

from __future__ import annotations

import dataclasses

from nandoctor.render.markdown import render_markdown
from nandoctor.report.types import Cause
from tests.render.test_terminal import failing_report, with_library_frames_and_transients


def test_markdown_carries_the_json_facts(tmp_path):
    report = failing_report(tmp_path)
    report.causes = [
        Cause(
            "log-of-softmax",
            "log of a softmax",
            0.93,
            ["12 zeros"],
            "use log_softmax",
            True,
            "76/76 steps",
        )
    ]
    text = render_markdown(report)
    data = report.to_dict()
    first = data["first_nonfinite"]
    assert text.startswith("## ❌ nandoctor diagnose: non-finite at step 3 (phase loss)")
    for value in (
        first["op"],
        first["tensor"],
        first["source"],
        f"{first['count_nonfinite']} × {first['value']}",
    ):
        assert f"`{value}`" in text
    assert "1. **log-of-softmax** (93%)" in text and "**✔ verified**: 76/76 steps" in text
    assert "```python" in text  # the before/after snippet of the top cause
    assert data["summary"] in text and "- a note" in text
    assert "; GradScaler skips: 1 overflow, 1 unchecked." in text  # counted from the events


def test_healthy_markdown(tmp_path):
    report = failing_report(tmp_path)
    report.status, report.first_nonfinite = "healthy", None
    assert render_markdown(report).startswith("## ✅ nandoctor diagnose: healthy")


def test_with_fail_on_divergence_a_diverged_run_is_titled_failed(tmp_path):
    """`--fail-on-divergence` exits 1: the job summary must not show a green tick."""
    from tests.render.test_junit import divergence_at

    report = failing_report(tmp_path)
    report.status, report.first_nonfinite = "healthy", None
    report.events = [divergence_at(40), divergence_at(42)]
    title = render_markdown(report, divergence_fails=True).splitlines()[0]
    assert title == "## ❌ nandoctor diagnose: diverged at step 40 (every step finite)"
    assert render_markdown(report).startswith("## ✅ nandoctor diagnose: healthy")


def test_markdown_lists_the_health_checks(tmp_path):
    from nandoctor.report.gate import Gate, GateCheck

    report = failing_report(tmp_path)
    report.status, report.first_nonfinite = "healthy", None
    report.gate = Gate("b.json", [GateCheck("final loss", False, "worse by 20%")])
    text = render_markdown(report)
    assert text.startswith("## ❌ nandoctor diagnose: a numeric-health check failed")
    assert (
        "### Numeric health against `b.json`" in text
        and "| final loss | ❌ | worse by 20% |" in text
    )


def test_markdown_shows_the_library_lines_and_the_healed_values(tmp_path):
    text = render_markdown(with_library_frames_and_transients(failing_report(tmp_path)))
    assert "| via | `torch/nn/functional.py:3555 ← transformers/x.py:9` |" in text
    assert "**Healed on the way** (seen, not the cause):" in text
    assert "- `aten.log.default in enc.0 at train.py:3 (forward, -inf)`" in text
    assert "None" not in text


def test_a_non_finite_batch_is_in_no_module(tmp_path):
    report = failing_report(tmp_path)
    assert "(outside the model)" in render_markdown(report)  # the loss phase's
    report.first_nonfinite = dataclasses.replace(report.first_nonfinite, phase="input")
    text = render_markdown(report)
    assert "(none: the batch)" in text and "outside the model" not in text
