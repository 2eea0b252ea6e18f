"""`lint_paths`: which files are read, what happens to broken ones, suppressions."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from nandoctor.errors import UsageError
from nandoctor.lint import LintConfig, LintResult, Severity, lint_paths, lint_text
from nandoctor.lint import registry as registry_module
from nandoctor.lint.registry import all_checks
from nandoctor.lint.suppress import parse_suppressions

BAD = "import torch\np = torch.softmax(x, -1)\nloss = torch.log(p)\n"


def write(folder, relative: str, text: str = BAD):
    path = folder / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_folders_are_searched_recursively_skipping_other_peoples_code(tmp_path):
    for relative in ("train.py", "pkg/model.py", "pkg/sub/loss.py"):
        write(tmp_path, relative)
    for skipped in (
        ".venv/x.py",
        "venv/x.py",
        ".git/x.py",
        "node_modules/x.py",
        "pkg/__pycache__/x.py",
        "lib/site-packages/x.py",
        "notes.txt",
    ):
        write(tmp_path, skipped)
    result = lint_paths([tmp_path])
    assert result.files_checked == 3
    assert {f.path.rsplit("/", 1)[-1] for f in result.findings} == {
        "train.py",
        "model.py",
        "loss.py",
    }


def test_a_file_named_explicitly_is_read_whatever_its_suffix(tmp_path):
    script = write(tmp_path, "train", BAD)
    assert [f.id for f in lint_paths([script]).findings] == ["log-of-softmax"]


def test_each_file_is_read_once(tmp_path):
    script = write(tmp_path, "train.py")
    assert lint_paths([script, tmp_path, script]).files_checked == 1


def test_excluded_globs_are_relative_to_the_config(tmp_path):
    write(tmp_path, "train.py")
    write(tmp_path, "old/train.py")
    config = LintConfig(exclude=("old/*",), root=tmp_path)
    assert lint_paths([tmp_path], config).files_checked == 1


def test_a_missing_path_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file or folder"):
        lint_paths([tmp_path / "nope.py"])


def test_a_syntax_error_is_reported_with_its_line(tmp_path):
    broken = write(tmp_path, "broken.py", "import torch\ndef f(:\n    pass\n")
    write(tmp_path, "train.py")
    result = lint_paths([tmp_path])
    (skipped,) = result.skipped
    assert skipped.path.endswith("broken.py")
    assert skipped.line == 2 and "invalid syntax" in skipped.reason
    assert [f.id for f in result.findings] == ["log-of-softmax"], "the other file is still linted"
    assert result.fails(Severity.ERROR)
    assert broken.exists()


def test_undecodable_bytes_are_reported_with_their_line_and_the_remedy(tmp_path):
    path = tmp_path / "latin.py"
    path.write_bytes(b"import torch\nname = '\xe9'\n")
    result = lint_paths([path])
    (skipped,) = result.skipped
    assert (skipped.line, skipped.column) == (2, 9)
    assert skipped.reason.startswith("cannot read: byte 0xe9 is not utf-8")
    assert "coding:" in skipped.reason
    assert result.files_checked == 0 and result.fails(Severity.ERROR)


@pytest.mark.parametrize("first_line", [b"x = '\xff\xfe'\n", b"import torch\ny = '\xff'\n"])
def test_undecodable_bytes_in_the_first_two_lines_have_their_line_too(tmp_path, first_line):
    # Python's encoding detection reads them: "invalid or missing encoding declaration"
    path = tmp_path / "latin.py"
    path.write_bytes(first_line)
    (skipped,) = lint_paths([path]).skipped
    assert skipped.line == first_line.count(b"\n", 0, first_line.index(b"\xff")) + 1
    assert skipped.reason.startswith("cannot read: byte 0xff is not utf-8")


def test_a_cookie_naming_no_encoding_says_so(tmp_path):
    path = tmp_path / "odd.py"
    path.write_bytes(b"# -*- coding: klingon -*-\nimport torch\n")
    (skipped,) = lint_paths([path]).skipped
    assert "unknown encoding" in skipped.reason and "klingon" in skipped.reason


def test_a_nul_byte_is_reported_with_its_line(tmp_path):
    path = write(tmp_path, "blob.py", "import torch\nx = 1\0\n")
    (skipped,) = lint_paths([path]).skipped
    assert (skipped.line, skipped.column, skipped.reason) == (2, 6, "a NUL byte: not Python source")


def test_a_syntax_error_says_its_reason_once():
    (skipped,) = lint_text("import torch\nx = = 1\n").skipped
    assert skipped.reason == "invalid syntax"
    (skipped,) = lint_text("import torch\nf(\n").skipped
    assert skipped.reason == "invalid syntax: '(' was never closed"


def test_only_files_read_and_parsed_count_as_checked(tmp_path):
    write(tmp_path, "broken.py", "import torch\ndef f(:\n")
    write(tmp_path, "train.py")
    result = lint_paths([tmp_path])
    assert result.files_checked == 1 and len(result.skipped) == 1


def test_a_coding_cookie_is_honoured(tmp_path):
    path = tmp_path / "latin.py"
    path.write_bytes(b"# -*- coding: latin-1 -*-\nimport torch\nname = '\xe9'\n")
    assert lint_paths([path]).skipped == ()


def test_files_that_never_mention_torch_are_not_checked():
    assert lint_text("p = softmax(x)\ny = log(p)\nz = x.softmax(-1).log()\n").findings == ()


def test_a_pasted_snippet_without_imports_is_checked_with_the_conventional_names():
    snippet = "p = F.softmax(logits, -1)\nloss = torch.log(p).mean()\n"
    assert [(f.line, f.id) for f in lint_text(snippet).findings] == [(2, "log-of-softmax")]


def test_folders_of_notebooks_are_searched(tmp_path):
    write(tmp_path, "nb/explore.ipynb", '{"cells": []}')
    write(tmp_path, "nb/.ipynb_checkpoints/explore-checkpoint.ipynb", "{}")
    result = lint_paths([tmp_path / "nb"])
    assert result.files_checked == 1 and result.skipped == (), "checkpoints are not read"


def test_suppression_by_id_and_for_all():
    text = BAD.replace("torch.log(p)", "torch.log(p)  # nandoctor: ignore[log-of-softmax]")
    outcome = lint_text(text)
    assert outcome.findings == () and outcome.suppressed == 1
    other = BAD.replace("torch.log(p)", "torch.log(p)  # nandoctor: ignore[eps-underflow]")
    assert len(lint_text(other).findings) == 1
    everything = BAD.replace("torch.log(p)", "torch.log(p)  # NANDOCTOR: ignore")
    assert lint_text(everything).findings == ()


def test_suppression_comments_are_parsed_from_comments_only():
    parsed = parse_suppressions(
        "a = 1  # nandoctor: ignore[x, y]\nb = '# nandoctor: ignore'\n# nandoctor: ignore\n"
    )
    assert parsed.by_line == {1: frozenset({"x", "y"}), 3: None}
    assert parsed.covers("x", 1, 1) and not parsed.covers("z", 1, 2) and parsed.covers("z", 2, 3)


def test_select_ignore_and_severity_overrides():
    text = BAD + "y = x / (n + 1e-8)\nm = Net().half()\ny.backward()\n"
    assert {f.id for f in lint_text(text).findings} == {"log-of-softmax", "eps-underflow"}
    only = LintConfig(select=frozenset({"eps-underflow"}))
    assert {f.id for f in lint_text(text, config=only).findings} == {"eps-underflow"}
    skip = LintConfig(ignore=frozenset({"eps-underflow"}))
    assert {f.id for f in lint_text(text, config=skip).findings} == {"log-of-softmax"}
    softer = LintConfig(severity={"log-of-softmax": Severity.INFO})
    severities = {f.id: f.severity for f in lint_text(text, config=softer).findings}
    assert severities["log-of-softmax"] is Severity.INFO


def test_fail_on_compares_severities():
    outcome = lint_text(BAD.replace("torch.log(p)", "torch.log(p + 1e-8)"))
    (finding,) = outcome.findings
    assert finding.severity is Severity.WARNING
    result = LintResult(outcome.findings, (), files_checked=1, suppressed=0)
    assert result.fails(Severity.INFO) and result.fails(Severity.WARNING)
    assert not result.fails(Severity.ERROR)
    assert result.counts() == {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 0}


def test_a_check_that_crashes_is_reported_not_raised(monkeypatch):
    def broken(src):
        raise RuntimeError("boom")

    unit = all_checks()["eps-underflow"]
    monkeypatch.setitem(registry_module.TABLE, "eps-underflow", replace(unit, run=broken))
    outcome = lint_text(BAD)
    assert [f.id for f in outcome.findings] == ["log-of-softmax"]
    (skipped,) = outcome.skipped
    assert "check eps-underflow failed (RuntimeError: boom)" in skipped.reason


def test_deeply_nested_arithmetic_stays_fast():
    text = "import torch\ny = " + " + ".join(["(a * 2 - 1e-8) / (b + 1)"] * 400) + "\n"
    assert lint_text(text).skipped == ()


def test_a_long_file_with_a_masked_softmax_is_linted_in_linear_time():
    """A pre-commit hook must never stall: when each assignment re-split the whole text,
    a 4000-line file whose `-inf` fill reaches a softmax took 30 s here (a user's 9000
    lines, minutes). Now a fraction of a second; the bound guards against a hang with a
    wide margin, it is no speed target."""
    head = (
        "import torch\nimport torch.nn.functional as F\n"
        "def attend(scores, pad):\n"
        "    scores = scores.masked_fill(pad, float('-inf'))\n"
        "    return F.softmax(scores, dim=-1)\n"
    )
    body = "".join(f"v{i} = torch.zeros({i})\n" for i in range(4000))
    started = time.perf_counter()
    result = lint_text(head + body)
    assert time.perf_counter() - started < 5
    assert [f.id for f in result.findings] == ["fully-masked-softmax"]
