"""`[tool.nandoctor.lint]` in pyproject.toml, merged with the command line."""

from __future__ import annotations

import textwrap

import pytest

from nandoctor.errors import ConfigError, UsageError
from nandoctor.lint import LintConfig, Severity, load_config


def project(tmp_path, table: str, subfolder: str = "src"):
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent(table), encoding="utf-8")
    folder = tmp_path / subfolder
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text("import torch\n", encoding="utf-8")
    return folder / "train.py"


def test_defaults_without_a_table(tmp_path):
    (tmp_path / "train.py").write_text("", encoding="utf-8")
    config = load_config([tmp_path / "train.py"])
    assert config.select is None and config.ignore == frozenset()
    assert config.fail_on is Severity.WARNING
    assert config.enabled("log-of-softmax")


def test_the_nearest_table_upward_from_the_first_path(tmp_path):
    train = project(
        tmp_path,
        """
        [tool.nandoctor.lint]
        select = ["log-of-softmax", "clip-before-unscale"]
        ignore = ["clip-before-unscale"]
        fail-on = "error"
        severity = { log-of-softmax = "warning" }
        exclude = ["old/*"]
        """,
        subfolder="src/deep",
    )
    config = load_config([train])
    assert config.select == {"log-of-softmax", "clip-before-unscale"}
    assert config.enabled("log-of-softmax")
    assert not config.enabled("clip-before-unscale")
    assert not config.enabled("eps-underflow")
    assert config.fail_on is Severity.ERROR
    assert config.severity_of("log-of-softmax", Severity.ERROR) is Severity.WARNING
    assert config.exclude == ("old/*",)
    assert config.root == tmp_path


def test_a_pyproject_without_the_table_is_passed_over(tmp_path):
    project(tmp_path, '[tool.nandoctor.lint]\nfail-on = "info"\n')
    inner = tmp_path / "pkg"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "pkg"\n', encoding="utf-8")
    assert load_config([inner]).fail_on is Severity.INFO


def test_the_command_line_overrides(tmp_path):
    train = project(
        tmp_path, '[tool.nandoctor.lint]\nignore = ["eps-underflow"]\nfail-on = "error"\n'
    )
    config = load_config(
        [train],
        select=["log-of-softmax,eps-underflow"],
        ignore=["division-by-zero"],
        fail_on="info",
    )
    assert config.select == {"log-of-softmax", "eps-underflow"}
    assert config.ignore == {"eps-underflow", "division-by-zero"}, "--ignore adds"
    assert config.fail_on is Severity.INFO
    assert not config.enabled("eps-underflow")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('fail_on = "error"', "unknown key 'fail_on'"),
        ('select = ["log-softmax"]', "unknown check id 'log-softmax'"),
        ('fail-on = "fatal"', "'fatal' is not a severity"),
        ("ignore = 3", "expected a list of strings"),
        ('severity = { eps-underflow = "loud" }', "'loud' is not a severity"),
    ],
)
def test_config_errors_name_the_file_and_key(tmp_path, table, message):
    train = project(tmp_path, f"[tool.nandoctor.lint]\n{table}\n")
    with pytest.raises(ConfigError, match=message) as caught:
        load_config([train])
    assert "pyproject.toml" in caught.value.message


def test_a_close_misspelling_gets_a_hint(tmp_path):
    train = project(tmp_path, '[tool.nandoctor.lint]\nselect = ["log-of-sofmax"]\n')
    with pytest.raises(ConfigError) as caught:
        load_config([train])
    assert caught.value.hint == "did you mean 'log-of-softmax'?"


def test_invalid_toml_is_a_config_error(tmp_path):
    train = project(tmp_path, "[tool.nandoctor.lint\nselect = [\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config([train])


def test_unknown_ids_on_the_command_line_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="--ignore: unknown check id 'nope'"):
        load_config([tmp_path], ignore=["nope"])


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        LintConfig().fail_on = Severity.INFO  # type: ignore[misc]


def test_a_cause_without_a_lint_check_says_so(tmp_path):
    with pytest.raises(UsageError, match="a cause that lint has no check for") as caught:
        load_config([tmp_path], select=["grad-scaler-collapse"])
    assert "log-of-softmax" in (caught.value.hint or "")
