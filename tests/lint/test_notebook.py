"""Notebooks: the code cells linted as one module, findings placed back in their cells."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import nandoctor.cli.lint  # noqa: F401  (adds the command to the app)
from nandoctor.cli.app import app
from nandoctor.lint import LintConfig, lint_paths
from nandoctor.lint.findings import Severity
from nandoctor.lint.notebook import parse_cells, python_line

runner = CliRunner()


def cell(source: str, kind: str = "code") -> dict:
    return {"cell_type": kind, "metadata": {}, "source": source.splitlines(keepends=True)}


def notebook(folder, name: str, *cells: dict):
    path = folder / name
    path.write_text(json.dumps({"cells": list(cells), "nbformat": 4, "nbformat_minor": 5}))
    return path


SOFTMAX_NB = (
    cell("%matplotlib inline\n!pip install torch\nimport torch"),
    cell("# Training", kind="markdown"),
    cell(
        "logits = model(x)\n\n\n\n\n\n\n\n\n\n\np = torch.softmax(logits, -1)\nloss = torch.log(p)"
    ),
)


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_hand_written_log_softmax_is_found_in_its_cell(here):
    notebook(here, "explore.ipynb", *SOFTMAX_NB)
    (finding,) = lint_paths(["explore.ipynb"], LintConfig()).findings
    assert (finding.id, finding.cell, finding.line, finding.column) == ("log-of-softmax", 3, 13, 8)
    assert finding.code == "loss = torch.log(p)"


@pytest.mark.parametrize(
    ("cells", "pointer"),
    [
        (("p = torch.softmax(x, -1)", "loss = torch.log(p)"), "(from cell 3, line 1)"),
        (("x = 1\n\np = torch.softmax(x, -1)\nloss = torch.log(p)",), "(from line 3)"),
    ],
)
def test_a_message_points_at_the_cell_and_line_a_value_came_from(here, cells, pointer):
    """Not at a line of the cells joined together (the softmax of the first case is line
    3 of the module the checks read)."""
    notebook(
        here, "nb.ipynb", cell("import torch"), cell("# x", kind="markdown"), *map(cell, cells)
    )
    (finding,) = lint_paths(["nb.ipynb"], LintConfig()).findings
    assert pointer in finding.message


def test_the_cli_fails_with_the_cell_location(here):
    notebook(here, "explore.ipynb", *SOFTMAX_NB)
    result = runner.invoke(app, ["lint", "explore.ipynb"])
    assert result.exit_code == 1
    assert "explore.ipynb:cell 3:13:8: error[log-of-softmax]" in result.stdout
    assert " 13 | loss = torch.log(p)" in result.stdout


def test_ipython_lines_are_not_python_but_keep_their_place():
    assert python_line("%matplotlib inline") == "pass"
    assert python_line("    !nvidia-smi") == "    pass"
    assert python_line("files = !ls data") == "pass"
    assert python_line("torch.log?") == "pass"
    assert python_line("x = a % b") == "x = a % b"
    nb = parse_cells([cell("%%bash\nrm -rf /tmp/x"), cell("if ok:\n    %time f()\n")])
    assert nb.text.splitlines() == ["", "", "if ok:", "    pass"]
    assert nb.where(4) == (2, 2)


def test_cells_share_one_namespace():
    """The import in cell 1 holds in cell 2; a cell without imports still means torch."""
    nb = parse_cells([cell("import torch.nn.functional as G"), cell("G.softmax(x).log()")])
    assert nb.text == "import torch.nn.functional as G\nG.softmax(x).log()\n"


def test_an_unparsable_notebook_is_skipped_and_fails(here):
    (here / "broken.ipynb").write_text("{not json")
    notebook(here, "syntax.ipynb", cell("import torch"), cell("def f(:\n    pass"))
    result = runner.invoke(app, ["lint", "."])
    assert result.exit_code == 1, result.output
    assert "broken.ipynb: error[not-linted] cannot read: not a notebook" in result.stdout
    assert "syntax.ipynb:cell 2:1:7: error[not-linted] invalid syntax" in result.stdout
    assert (
        "No problems in 1 file checked; 1 file and 1 notebook cell could not be linted."
        in result.stdout
    )


def test_a_cell_that_does_not_parse_hides_nothing_in_the_others(here):
    """Jupyter compiles each cell on its own: a half-written cell is named (and fails the
    run), and the cells around it are still linted, the names they share included."""
    notebook(
        here,
        "nb.ipynb",
        cell("import torch\np = torch.softmax(x, -1)"),
        cell("for batch in loader:\n    loss = ("),
        cell("loss = torch.log(p)"),
    )
    result = lint_paths(["nb.ipynb"], LintConfig())
    assert [(f.id, f.cell, f.line) for f in result.findings] == [("log-of-softmax", 3, 1)]
    (skipped,) = result.skipped
    assert (skipped.cell, skipped.line, skipped.reason) == (
        2,
        2,
        "invalid syntax: '(' was never closed",
    )
    assert result.fails(Severity.ERROR)


def test_a_cell_is_compiled_as_ipython_would():
    """IPython lines and cell magics are not syntax errors; only Python that is one is."""
    nb = parse_cells([cell("%%time\nx ="), cell("!ls\nif ok:\n    %time f()"), cell("x =")])
    assert [(e.cell, e.line) for e in nb.errors] == [(3, 1)]
    assert nb.text == "\n\npass\nif ok:\n    pass\n\n"


def test_a_clean_notebook_passes(here):
    notebook(
        here, "ok.ipynb", cell("import torch.nn.functional as F"), cell("F.cross_entropy(z, y)")
    )
    result = runner.invoke(app, ["lint", "ok.ipynb"])
    assert result.exit_code == 0, result.output
    assert result.stdout == "No problems in 1 file checked.\n"


def test_ipython_lines_continued_with_a_backslash_and_indented_cells_are_read_as_ipython_does():
    """`!pip install -q \\` goes on to the next lines, and a cell whose first line is
    indented is dedented: Jupyter runs both cells, so neither is a syntax error."""
    nb = parse_cells(
        [
            cell("!pip install -q \\\n    transformers \\\n    accelerate\nimport torch"),
            cell("%run train.py \\\n--epochs 1"),
            cell("    x = torch.ones(2)\n    if x.sum() > 0:\n        y = torch.log(x)"),
            cell("total = 1 + \\\n    2"),
        ]
    )
    assert nb.errors == ()
    assert nb.text.splitlines() == [
        "pass", "", "", "import torch",
        "pass", "",
        "x = torch.ones(2)", "if x.sum() > 0:", "    y = torch.log(x)",
        "total = 1 + \\", "    2",
    ]  # fmt: skip


def test_an_indented_cells_finding_is_placed_where_the_cell_writes_it(here):
    """The cell is linted dedented, as IPython runs it; its columns (the caret's, SARIF's
    region in the .ipynb file) count in the cell as written."""
    path = notebook(
        here,
        "explore.ipynb",
        cell("import torch"),
        cell("    probs = torch.softmax(x, -1)\n    loss = -torch.log(probs).mean()"),
    )
    (finding,) = lint_paths(["explore.ipynb"], LintConfig()).findings
    code = "    loss = -torch.log(probs).mean()"
    assert (finding.cell, finding.line, finding.code) == (2, 2, code)
    assert code[finding.column - 1 : finding.end_column - 1] == "torch.log(probs)"
    assert finding.in_file is not None
    line, column, _, end_column = finding.in_file
    written = path.read_text().splitlines()[line - 1]
    assert written[column - 1 : end_column - 1] == "torch.log(probs)"
