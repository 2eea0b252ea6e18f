"""The output formats: the terminal listing (golden), JSON, and SARIF 2.1.0's structure."""

from __future__ import annotations

import io
import json

from rich.console import Console

from nandoctor.lint import LintResult, lint_paths, lint_text
from nandoctor.lint.findings import Skipped
from nandoctor.lint.registry import all_checks
from nandoctor.lint.render import terminal
from nandoctor.lint.render.json_report import to_json
from nandoctor.lint.render.sarif import SCHEMA, to_sarif

SCRIPT = """\
import torch
def step(model, scaler, opt, loss, logits):
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    return torch.log(torch.softmax(logits, -1))  # nandoctor: ignore[log-of-softmax]
"""


def result(skipped: tuple[Skipped, ...] = ()) -> LintResult:
    outcome = lint_text(SCRIPT, "train.py")
    return LintResult(outcome.findings, skipped, files_checked=2, suppressed=outcome.suppressed)


def render(value: LintResult, quiet: bool = False) -> str:
    console = Console(file=io.StringIO(), width=100, force_terminal=False, soft_wrap=True)
    terminal.render(console, value, quiet=quiet)
    return console.file.getvalue()  # type: ignore[attr-defined]


GOLDEN = """\
train.py:4:5: error[clip-before-unscale] Call `scaler.unscale_(opt)` before `clip_grad_norm_`: \
the gradients are still multiplied by the loss scale (65536 at the start), so the clip threshold \
is applied to the scaled norm and the real update shrinks by that factor.
    |
  4 | torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    | ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
    = fix: Call `scaler.unscale_(opt)` right before `clip_grad_norm_`: the threshold then applies \
to the true gradients, and `scaler.step(opt)` still skips the step if they hold inf or NaN.

broken.py:3:9: error[not-linted] invalid syntax: expected ':'
Found 1 problem (1 error) in 1 of 2 files checked; 1 suppressed; 1 file could not be linted.
"""


def test_terminal_listing():
    skipped = (Skipped("broken.py", "invalid syntax: expected ':'", 3, 9),)
    assert render(result(skipped)) == GOLDEN


def test_terminal_quiet_keeps_one_line_per_finding():
    lines = render(result(), quiet=True).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("train.py:4:5: error[clip-before-unscale] Call")
    assert lines[1] == "Found 1 problem (1 error) in 1 of 2 files checked; 1 suppressed."


def test_the_summary_counts_each_severity_in_agreement():
    found = result().findings
    doubled = LintResult(found * 2, (), files_checked=1, suppressed=0)
    assert terminal.summary(doubled).plain.startswith("Found 2 problems (2 errors) in 1 of")


def test_terminal_caret_follows_the_dedented_code():
    text = render(
        LintResult(
            lint_text(
                "import torch\nif a:\n    y = 2 * torch.log(x.softmax(-1))\n", "t.py"
            ).findings,
            (),
            1,
            0,
        )
    )
    code, caret = text.splitlines()[2:4]
    assert code == "  3 | y = 2 * torch.log(x.softmax(-1))"
    assert caret == "    |         ^^^^^^^^^^^^^^^^^^^^^^^^"


def test_terminal_heuristics_are_marked():
    text = (
        "import torch\nclass M(torch.nn.Module):\n    def forward(self, x):\n"
        "        return x / x.sum()\n"
    )
    first = render(LintResult(lint_text(text, "m.py").findings, (), 1, 0)).splitlines()[0]
    assert first.startswith("m.py:4:16: info[division-by-zero] (heuristic) Clamp")


def test_terminal_clean_and_empty():
    assert render(LintResult((), (), 3, 0)) == "No problems in 3 files checked.\n"
    assert render(LintResult((), (), 0, 0)) == "No Python files or notebooks found.\n"


def test_json_report():
    document = json.loads(to_json(result()))
    assert document["schema_version"] == 1
    assert document["command"] == "lint" and document["status"] == "findings"
    assert document["summary"] == {"error": 1, "warning": 0, "info": 0}
    assert document["suppressed"] == 1 and document["files_checked"] == 2
    (finding,) = document["findings"]
    assert finding["id"] == "clip-before-unscale"
    assert (finding["line"], finding["column"], finding["end_line"], finding["end_column"]) == (
        4,
        5,
        4,
        60,
    )
    assert finding["title"] and finding["fix"].startswith("Call `scaler.unscale_(opt)`")
    assert finding["heuristic"] is False


def test_json_clean_report():
    document = json.loads(to_json(LintResult((), (), 1, 0)))
    assert document["status"] == "clean" and document["findings"] == []


def test_sarif_has_the_required_structure():
    skipped = (Skipped("broken.py", "invalid syntax", 3, 9),)
    document = json.loads(to_sarif(result(skipped)))
    assert document["version"] == "2.1.0"
    assert document["$schema"] == SCHEMA
    (run,) = document["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "nandoctor" and driver["version"]
    rules = driver["rules"]
    assert [r["id"] for r in rules] == list(all_checks())
    for rule in rules:
        assert rule["shortDescription"]["text"] and rule["fullDescription"]["text"]
        assert rule["help"]["text"] and rule["help"]["markdown"]
        assert rule["defaultConfiguration"]["level"] in ("error", "warning", "note")
    (found,) = run["results"]
    assert found["ruleId"] == "clip-before-unscale"
    assert rules[found["ruleIndex"]]["id"] == found["ruleId"]
    assert found["level"] == "error"
    assert found["message"]["text"].startswith("Call `scaler.unscale_(opt)`")
    (location,) = found["locations"]
    physical = location["physicalLocation"]
    assert physical["artifactLocation"] == {"uri": "train.py", "uriBaseId": "%SRCROOT%"}
    assert physical["region"] == {
        "startLine": 4,
        "startColumn": 5,
        "endLine": 4,
        "endColumn": 60,
        "snippet": {"text": "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)"},
    }
    (invocation,) = run["invocations"]
    assert invocation["executionSuccessful"] is True
    (note,) = invocation["toolExecutionNotifications"]
    assert note["level"] == "error" and "invalid syntax" in note["message"]["text"]
    assert run["originalUriBaseIds"]["%SRCROOT%"]["uri"].startswith("file://")


def test_sarif_levels_and_heuristic_precision():
    rules = {
        r["id"]: r
        for r in json.loads(to_sarif(LintResult((), (), 0, 0)))["runs"][0]["tool"]["driver"][
            "rules"
        ]
    }
    assert rules["division-by-zero"]["defaultConfiguration"]["level"] == "note"
    assert rules["division-by-zero"]["properties"]["precision"] == "low"
    assert rules["log-of-softmax"]["properties"]["precision"] == "high"
    assert rules["exploding-gradients"]["defaultConfiguration"]["level"] == "warning"
    assert rules["log-of-softmax"]["name"] == "LogOfSoftmax"


def test_sarif_paths_outside_the_working_directory_are_file_uris(tmp_path):
    outcome = lint_text(
        SCRIPT.replace("  # nandoctor: ignore[log-of-softmax]", ""), str(tmp_path / "t.py")
    )
    locations = [
        r["locations"][0]["physicalLocation"]["artifactLocation"]
        for r in json.loads(to_sarif(LintResult(outcome.findings, (), 1, 0)))["runs"][0]["results"]
    ]
    assert all(loc["uri"].startswith("file:///") and "uriBaseId" not in loc for loc in locations)


def test_sarif_places_a_notebook_finding_in_the_ipynb_file(tmp_path, monkeypatch):
    """SARIF's regions count lines of the file a viewer opens: for a notebook that is the
    .ipynb file's JSON, whatever its layout (Jupyter's one string per line and indent, one
    line, escaped non-ASCII); the cell and its line are the result's properties."""
    monkeypatch.chdir(tmp_path)
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Notes é\n"]},
        {
            "cell_type": "code",
            "metadata": {},
            "outputs": [{"output_type": "stream", "text": ["p = torch.softmax(z, -1)\n"]}],
            "source": ["import torch  # é\n", "p = torch.softmax(z, -1)\n", "l = torch.log(p)"],
        },
        {"cell_type": "code", "metadata": {}, "source": "x = 1\ndef f(:\n    pass"},
    ]
    for layout in ({"indent": 1, "ensure_ascii": False}, {"indent": 1}, {}):
        path = tmp_path / "nb.ipynb"
        text = json.dumps({"cells": cells, "nbformat": 4, "nbformat_minor": 5}, **layout)
        path.write_text(text, encoding="utf-8")
        run = json.loads(to_sarif(lint_paths(["nb.ipynb"])))["runs"][0]
        (found,) = run["results"]
        region = found["locations"][0]["physicalLocation"]["region"]
        line = text.splitlines()[region["startLine"] - 1]
        assert region["endLine"] == region["startLine"], layout
        assert line[region["startColumn"] - 1 : region["endColumn"] - 1] == "torch.log(p)"
        assert found["properties"] | {"heuristic": False} == {
            "heuristic": False,
            "notebookCell": 2,
            "cellLine": 3,
            "cellColumn": 5,
        }
        (broken,) = run["invocations"][0]["toolExecutionNotifications"]
        where = broken["locations"][0]["physicalLocation"]["region"]
        line = text.splitlines()[where["startLine"] - 1]
        assert line[where["startColumn"] - 1 :].startswith(":\\n    pass"), layout
        assert broken["properties"]["cellLine"] == 2
