"""What to check and what fails the run: defaults, `[tool.nandoctor.lint]`, then flags.

    [tool.nandoctor.lint]
    select = ["log-of-softmax", "clip-before-unscale"]   # default: every check
    ignore = ["division-by-zero"]
    fail-on = "error"                                    # error | warning | info
    severity = { exploding-gradients = "info" }          # per-id override
    exclude = ["experiments/old/*"]                      # globs, relative to pyproject.toml

The table is read from the nearest pyproject.toml that has one, searching upward from the
first PATH. On the command line, `--select` and `--fail-on` replace the table's value and
`--ignore` adds to its list. Unknown keys, ids and severities are errors (exit 2) that name
the file and offer the closest valid spelling.
"""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nandoctor.causes.catalog import CATALOG
from nandoctor.errors import ConfigError, UsageError
from nandoctor.lint.findings import Severity
from nandoctor.lint.registry import all_checks

CONFIG_TABLE = "[tool.nandoctor.lint]"
KEYS = ("select", "ignore", "fail-on", "severity", "exclude")


@dataclass(frozen=True)
class LintConfig:
    select: frozenset[str] | None = None  # None: every check
    ignore: frozenset[str] = frozenset()
    fail_on: Severity = Severity.WARNING
    severity: Mapping[str, Severity] = field(default_factory=dict)
    exclude: tuple[str, ...] = ()
    root: Path | None = None  # the folder of the pyproject.toml read, for `exclude`

    def enabled(self, check_id: str) -> bool:
        selected = self.select is None or check_id in self.select
        return selected and check_id not in self.ignore

    def severity_of(self, check_id: str, default: Severity) -> Severity:
        return self.severity.get(check_id, default)


def load_config(
    paths: Sequence[str | Path],
    *,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    fail_on: Severity | str | None = None,
) -> LintConfig:
    """The table of the nearest pyproject.toml, overridden by command-line values."""
    start = Path(paths[0]) if paths else Path.cwd()
    found = find_pyproject(start)
    config = from_table(*found) if found else LintConfig()
    if select is not None:
        config = replace(config, select=check_ids(select, "--select", UsageError))
    if ignore is not None:
        config = replace(config, ignore=config.ignore | check_ids(ignore, "--ignore", UsageError))
    if fail_on is not None:
        config = replace(config, fail_on=severity(fail_on, "--fail-on", UsageError))
    return config


def find_pyproject(start: Path) -> tuple[Path, dict[str, Any]] | None:
    """The nearest pyproject.toml upward from `start` that has a `[tool.nandoctor.lint]`
    table, and that table."""
    folder = start.resolve()
    folder = folder if folder.is_dir() else folder.parent
    for candidate in (folder, *folder.parents):
        path = candidate / "pyproject.toml"
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if "tool.nandoctor" not in text:
            continue  # NB: cheap, and spares us a TOML parser on unrelated projects
        table = _parse(path, text).get("tool", {}).get("nandoctor", {}).get("lint")
        if table is not None:
            return path, table
    return None


def from_table(path: Path, table: Any) -> LintConfig:
    where = f"{path} {CONFIG_TABLE}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table")
    for key in table:
        if key not in KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}", hint=_did_you_mean(key, KEYS))
    config = LintConfig(root=path.parent)
    if "select" in table:
        config = replace(config, select=check_ids(_strings(table, "select", where), where))
    if "ignore" in table:
        config = replace(config, ignore=check_ids(_strings(table, "ignore", where), where))
    if "fail-on" in table:
        config = replace(config, fail_on=severity(table["fail-on"], f"{where} fail-on"))
    if "exclude" in table:
        config = replace(config, exclude=tuple(_strings(table, "exclude", where)))
    if "severity" in table:
        config = replace(config, severity=_severities(table["severity"], where))
    return config


def check_ids(values: Iterable[str], where: str, error: type = ConfigError) -> frozenset[str]:
    """Ids as given (`a,b` and repeated flags both work), each a registered check."""
    known = all_checks()
    ids = frozenset(part.strip() for v in values for part in v.split(",") if part.strip())
    for cause_id in sorted(ids):
        if cause_id in CATALOG and cause_id not in known:
            hint = f"lint checks: {', '.join(known)}"
            raise error(f"{where}: {cause_id!r} is a cause that lint has no check for", hint)
        if cause_id not in known:
            raise error(f"{where}: unknown check id {cause_id!r}", _did_you_mean(cause_id, known))
    return ids


def severity(value: Any, where: str, error: type = ConfigError) -> Severity:
    try:
        return Severity(str(getattr(value, "value", value)).lower())
    except ValueError:
        choices = ", ".join(s.value for s in Severity)
        raise error(f"{where}: {value!r} is not a severity (expected {choices})") from None


def _severities(value: Any, where: str) -> dict[str, Severity]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} severity: expected a table of id = severity")
    ids = check_ids(value, f"{where} severity")
    return {i: severity(value[i], f"{where} severity.{i}") for i in ids}


def _strings(table: dict[str, Any], key: str, where: str) -> list[str]:
    value = table[key]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} {key}: expected a list of strings")
    return value


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(choices)}"


def _parse(path: Path, text: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover  (Python 3.10)
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(
                f"{path}: reading {CONFIG_TABLE} needs Python 3.11+ or the tomli package",
                hint="pip install tomli",
            ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
