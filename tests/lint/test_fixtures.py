"""The fixture scripts: every finding exactly where a `# expect: <id>` comment says.

Each file in tests/lint/fixtures/ is a small training script with positive forms (marked)
and negative forms (unmarked: aliases, methods, unrelated functions named `log`, causal
masks...) of one or more checks. Precision and recall are both asserted: a missing
finding and an extra one fail alike.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nandoctor.lint import lint_paths
from nandoctor.lint.registry import all_checks

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPECT = re.compile(r"#\s*expect:\s*([\w\-, ]+)$")


def expected(path: Path) -> set[tuple[int, str]]:
    marks = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = EXPECT.search(line)
        if match:
            marks |= {(number, i.strip()) for i in match.group(1).split(",")}
    return marks


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.py")), ids=lambda p: p.stem)
def test_fixture(path):
    result = lint_paths([path])
    assert result.skipped == ()
    found = {(f.line, f.id) for f in result.findings}
    want = expected(path)
    assert sorted(want - found) == [], "missed"
    assert sorted(found - want) == [], "false positives"


def test_every_check_has_positive_and_negative_fixtures():
    marked = {i for path in FIXTURES.glob("*.py") for _, i in expected(path)}
    assert marked == set(all_checks())
    silent = [p for p in FIXTURES.glob("*.py") if not expected(p)]
    assert len(silent) >= 4, "clean scripts keep the checks honest"


def test_the_fixture_folder_lints_in_one_call():
    result = lint_paths([FIXTURES])
    want = {(p.name, line, i) for p in FIXTURES.glob("*.py") for line, i in expected(p)}
    assert {(Path(f.path).name, f.line, f.id) for f in result.findings} == want
    assert result.files_checked == len(list(FIXTURES.glob("*.py")))
