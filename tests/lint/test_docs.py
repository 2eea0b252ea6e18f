"""docs/lint.md: generated from the checks, so every check is documented with its examples."""

from __future__ import annotations

import sys

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from nandoctor.lint.docs import render_lint_docs
from nandoctor.lint.registry import all_checks
from tests.helpers.paths import REPO

DOCS = REPO / "docs"


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


def test_the_published_pre_commit_hook_is_the_one_the_docs_recommend():
    # `language: system`: pre-commit's own python environment would install torch again
    (hook,) = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    script, command = hook["entry"].split()
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert (script, command) == ("nandoctor", "lint") and script in scripts
    assert hook["language"] == "system"
    assert set(hook["types_or"]) == {"python", "jupyter"}
    recipe = render_lint_docs().split("## pre-commit")[1].split("```yaml")[1].split("```")[0]
    (local,) = yaml.safe_load(recipe)["repos"][0]["hooks"]
    assert {k: local[k] for k in hook if k != "description"} == {
        k: v for k, v in hook.items() if k != "description"
    }
