"""docs/lint.md: generated from the checks, so every check is documented with its examples."""

from __future__ import annotations

from pathlib import Path

from nandoctor.lint.docs import render_lint_docs
from nandoctor.lint.registry import all_checks

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_committed_lint_md_is_generated():
    committed = (DOCS / "lint.md").read_text(encoding="utf-8")
    assert committed == render_lint_docs(), "run: python -m nandoctor.lint.docs > docs/lint.md"


def test_every_check_has_id_severity_examples_and_suppression():
    text = render_lint_docs()
    for check in all_checks().values():
        section = text.split(f"\n### {check.id}\n", 1)[1].split("\n### ", 1)[0]
        assert f"**{check.severity}" in section
        assert section.count("```python") == len(check.invalid) + len(check.valid)
        assert f"`# nandoctor: ignore[{check.id}]`" in section
        assert f"causes.md#{check.id}" in section


def test_usage_options_and_sarif_recipe():
    text = render_lint_docs()
    for option in ("--select", "--ignore", "--fail-on", "--json", "--sarif", "--quiet"):
        assert option in text
    assert "github/codeql-action/upload-sarif" in text
    assert "security-events: write" in text
    assert "[tool.nandoctor.lint]" in text
