"""`nandoctor lint` as a user and a CI job see it: exit codes, options, outputs, config."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import nandoctor.cli.lint  # noqa: F401  (adds the command to the app)
from nandoctor.cli.app import app

runner = CliRunner()

ERROR = "import torch\np = torch.softmax(x, -1)\nloss = torch.log(p)\n"
WARNING = "import torch\np = torch.softmax(x, -1)\nloss = torch.log(p + 1e-8)\n"
CLEAN = "import torch.nn.functional as F\nloss = F.cross_entropy(logits, y)\n"


@pytest.fixture
def here(tmp_path, monkeypatch):
    """Run from a throwaway project folder, so paths print relative and no pyproject leaks."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def script(folder, text: str, name: str = "train.py") -> str:
    (folder / name).write_text(text, encoding="utf-8")
    return name


def lint(*args: str):
    return runner.invoke(app, ["lint", *args])


def test_clean_exits_0(here):
    result = lint(script(here, CLEAN))
    assert result.exit_code == 0, result.output
    assert result.stdout == "No problems in 1 file checked.\n"


def test_findings_exit_1_with_location_code_and_fix(here):
    result = lint(script(here, ERROR))
    assert result.exit_code == 1
    assert "train.py:3:8: error[log-of-softmax]" in result.stdout
    assert "  3 | loss = torch.log(p)" in result.stdout
    assert "= fix: Use `F.cross_entropy(logits, target)`" in result.stdout


def test_fail_on_sets_the_threshold(here):
    path = script(here, WARNING)
    assert lint(path).exit_code == 1, "warning fails by default"
    assert lint(path, "--fail-on", "error").exit_code == 0
    assert lint(script(here, ERROR, "e.py"), "--fail-on", "error").exit_code == 1


def test_usage_errors_exit_2_in_one_line(here):
    missing = lint("nope.py")
    assert missing.exit_code == 2
    assert missing.stderr == "error: nope.py: no such file or folder\n"
    assert "Traceback" not in missing.output
    unknown = lint(script(here, ERROR), "--select", "log-softmax")
    assert unknown.exit_code == 2
    assert "unknown check id 'log-softmax'" in unknown.stderr
    assert "hint: did you mean 'log-of-softmax'?" in unknown.stderr
    assert lint(script(here, ERROR), "--fail-on", "fatal").exit_code == 2
    assert lint().exit_code == 2


def test_two_reports_on_stdout_is_a_usage_error(here):
    result = lint(script(here, ERROR), "--json", "-", "--sarif", "-")
    assert result.exit_code == 2
    assert "only one report can be written to stdout" in result.stderr


def test_json_to_stdout_moves_the_listing_to_stderr(here):
    result = lint(script(here, ERROR), "--json", "-")
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    assert [f["id"] for f in document["findings"]] == ["log-of-softmax"]
    assert "error[log-of-softmax]" in result.stderr


def test_sarif_file_is_written(here):
    result = lint(script(here, ERROR), "--sarif", "out.sarif", "--quiet")
    assert result.exit_code == 1
    document = json.loads((here / "out.sarif").read_text(encoding="utf-8"))
    (found,) = document["runs"][0]["results"]
    assert found["ruleId"] == "log-of-softmax"
    assert found["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "train.py"


def test_a_report_into_a_missing_folder_fails_before_linting(here):
    result = lint(script(here, ERROR), "--json", "no/such/folder/out.json")
    assert result.exit_code == 2
    assert "does not exist" in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("--json", "train.py", "other.py"),  # the slip: train.py read as the report's path
        ("train.py", "--sarif", "train.py"),
        (".", "--json", "pyproject.toml"),
        ("train.py", "--json", "notes.ipynb"),
    ],
)
def test_a_report_never_overwrites_a_file_lint_reads(here, args):
    """Never a user's file written: a script, a notebook or the pyproject.toml lint reads
    as a report's path is refused (exit 2), every file as it was."""
    script(here, ERROR)
    script(here, CLEAN, "other.py")
    (here / "pyproject.toml").write_text('[tool.nandoctor.lint]\nfail-on = "error"\n')
    (here / "notes.ipynb").write_text("{}")
    before = {p.name: p.read_bytes() for p in here.iterdir()}
    result = lint(*args)
    assert result.exit_code == 2
    assert "is a file lint reads; refusing to overwrite it" in result.stderr
    assert {p.name: p.read_bytes() for p in here.iterdir()} == before


def found_ids(*args: str) -> set[str]:
    return {f["id"] for f in json.loads(lint(*args, "--json", "-").stdout)["findings"]}


def test_select_and_ignore(here):
    both = script(here, ERROR + "m = Net().half()\ny = x / (n + 1e-8)\ny.backward()\n")

    def found(*opts: str) -> set[str]:
        return found_ids(both, *opts)

    assert found() == {"log-of-softmax", "eps-underflow"}
    assert found("--select", "eps-underflow") == {"eps-underflow"}
    assert found("--ignore", "eps-underflow,log-of-softmax") == set()
    assert found("--ignore", "eps-underflow", "--ignore", "log-of-softmax") == set()


def test_suppression_comments(here):
    path = script(
        here, ERROR.replace("torch.log(p)", "torch.log(p)  # nandoctor: ignore[log-of-softmax]")
    )
    result = lint(path)
    assert result.exit_code == 0
    assert result.stdout == "No problems in 1 file checked; 1 suppressed.\n"


DIVISION = """
def masked_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum()
masked_mean(l, m).backward()
"""


def test_pyproject_defaults_and_command_line_overrides(here):
    path = script(here, WARNING + DIVISION)
    assert found_ids(path) == {"log-of-softmax", "division-by-zero"}, "without the table"
    (here / "pyproject.toml").write_text(
        '[tool.nandoctor.lint]\nfail-on = "error"\nignore = ["division-by-zero"]\n',
        encoding="utf-8",
    )
    assert found_ids(path) == {"log-of-softmax"}, "ignore from pyproject.toml"
    assert lint(path).exit_code == 0, "fail-on = error from pyproject.toml"
    assert lint(path, "--fail-on", "warning").exit_code == 1, "the flag wins"
    assert found_ids(path, "--ignore", "log-of-softmax") == set(), "--ignore adds to the list"


def test_a_bad_pyproject_is_a_one_line_config_error(here):
    (here / "pyproject.toml").write_text(
        '[tool.nandoctor.lint]\nselcet = ["x"]\n', encoding="utf-8"
    )
    result = lint(script(here, ERROR))
    assert result.exit_code == 2
    assert "unknown key 'selcet'" in result.stderr and "did you mean 'select'?" in result.stderr


def test_a_file_that_does_not_parse_is_reported_and_fails(here):
    script(here, ERROR)
    script(here, "import torch\ndef f(:\n", "broken.py")
    result = lint(".")
    assert result.exit_code == 1
    assert "broken.py:2:7: error[not-linted] invalid syntax" in result.stdout
    assert "train.py:3:8: error[log-of-softmax]" in result.stdout


def test_a_lone_file_that_does_not_parse_is_no_file_checked(here):
    script(here, "import torch\ndef f(:\n", "broken.py")
    result = lint("broken.py")
    assert result.exit_code == 1
    assert result.stdout.endswith("No file checked: 1 file could not be linted.\n")


def test_the_help_names_notebooks():
    assert "*.ipynb" in runner.invoke(app, ["lint", "--help"]).stdout


def test_a_reader_that_stops_early_ends_nothing_but_the_listing(tmp_path):
    """`nandoctor lint . | head`: once the pipe closes, the listing stops quietly and the
    exit code stays the findings' (rich's default exited 1 as if the user's code had
    called sys.exit, and nandoctor reported it as exit 3)."""
    import subprocess
    import sys

    line = "loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()\n"
    (tmp_path / "train.py").write_text("import torch\n" + line * 1000)
    lint = subprocess.Popen(
        [sys.executable, "-m", "nandoctor", "lint", "train.py"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert lint.stdout is not None and lint.stderr is not None
    first = lint.stdout.readline()
    lint.stdout.close()  # NB: the reader is gone; a 1000-finding listing overflows the pipe
    error = lint.stderr.read().decode()
    assert lint.wait(timeout=60) == 1, error
    assert first.startswith(b"train.py:2:") and error == ""
