"""docs/lint.md, generated from the table of checks (`lint.registry`) and the catalog.

    python -m nandoctor.lint.docs > docs/lint.md

Every check's section shows its id, severity, what it looks for, its INVALID and VALID
examples (the same snippets the tests run) and how to suppress it; tests/lint/test_docs.py
fails when the committed file differs.
"""

from __future__ import annotations

import sys

from nandoctor.lint.registry import all_checks
from nandoctor.lint.unit import Check

HEADER = """\
<!-- Generated from nandoctor/lint/ by `python -m nandoctor.lint.docs > docs/lint.md`:
     edit the checks and nandoctor/lint/docs.py, not this file. -->

# `nandoctor lint`

Static checks for the training-script mistakes that end in NaN, in milliseconds per file
and without importing torch, so they run in code review before a GPU-day is spent:

```console
$ nandoctor lint train.py
train.py:9:26: error[log-of-softmax] Use `F.log_softmax` (or `F.cross_entropy` on the logits) \
instead of `torch.log` of a softmax: a probability that underflowed to 0 gives log(0) = -inf and \
a NaN gradient.
    |
  9 | loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()
    |              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
    = fix: Use `F.cross_entropy(logits, target)`, or `F.log_softmax(logits, dim=-1)` ...

Found 1 problem (1 error) in 1 of 1 file checked.
```

Each check is tied to a cause id of [causes.md](causes.md), which explains the numbers
behind it. Names are resolved through imports (`import torch.nn.functional as F`,
`from torch import log`, `from torch.nn.functional import softmax as sm`), so an alias does
not hide a finding and a `log` of your own, `math.log` or `np.log` does not raise one.
A snippet that never shows its imports (a pasted loop, a notebook cell) still means torch
by `torch`, `nn` and `F`, unless the file imports or assigns those names itself. Files that
never mention torch are read but not checked.

Jupyter notebooks (`*.ipynb`) are linted too: their code cells, in order, as one module
(the imports of one cell hold in the next). IPython lines (`%magic`, `!shell`, `x = !ls`,
`name?`, and the lines they continue onto with a trailing `\\`) are skipped, a cell whose
first line is indented is dedented as IPython does, and a cell that starts with a cell
magic (`%%bash`, `%%time`) is not checked. A finding names its cell, counted from 1 with
markdown cells included, and the line inside it:
`explore.ipynb:cell 3:12:8: error[log-of-softmax] ...`. A notebook that is not valid JSON
is reported as not linted and fails the run. A cell with a syntax error (a
half-written one) is named with its line and fails the run too, but hides nothing: Jupyter
compiles each cell on its own, so the other cells are linted without it.

## Usage

```console
nandoctor lint PATH... [--select ID,...] [--ignore ID,...] [--fail-on error|warning|info]
                       [--json PATH|-] [--sarif PATH|-] [--quiet] [--debug]
```

- `PATH`: files (linted whatever their suffix; `.ipynb` read as a notebook) or folders,
  searched recursively for `*.py` and `*.ipynb`; hidden folders, `venv`, `.venv`,
  `__pycache__`, `site-packages` and `node_modules` are skipped.
- `--select`, `--ignore`: check ids, comma-separated or repeated.
- `--fail-on`: the lowest severity that makes the exit code 1 (default `warning`).
- `--json PATH`, `--sarif PATH`: write the findings as JSON or SARIF 2.1.0 (`-` is stdout;
  the listing then goes to stderr). A path lint reads (a `.py` or `.ipynb` file, a path
  given to lint, a `pyproject.toml`) is refused: `--json train.py other.py` would
  otherwise write the report over `train.py`.
- `--quiet`: one line per finding, no code excerpt.

Exit codes: **0** no finding at or above `--fail-on`; **1** such findings, or a file that
could not be linted (a syntax error, bytes that are not its encoding's or a NUL byte is
reported with its line, never a crash; such a file does not count among the files
checked, the JSON's `files_checked` included); **2** a usage or configuration error (a
missing PATH, an unknown id), in one line.

Severities: **error**: produces inf/NaN whenever the values get there; **warning**: likely
to in some runs; **info**: a heuristic, marked `(heuristic)`, worth a look and often fine.

## Suppressing a finding

Add a comment on the reported line, or on any line of its statement (a call a formatter
wrapped: its first or its closing line; of an `if`, `for` or `with`, the header's lines,
not the body's):

```python
loss = torch.log(probs)  # nandoctor: ignore[log-of-softmax]
y = x / x.sum()          # nandoctor: ignore          (every check, this line)
```

Several ids: `# nandoctor: ignore[eps-underflow, division-by-zero]`.

## Configuration

Defaults for a project go in the nearest `pyproject.toml` (searched upward from the first
PATH) that has the table; the command line overrides them (`--select` and `--fail-on`
replace, `--ignore` adds):

```toml
[tool.nandoctor.lint]
select = ["log-of-softmax", "clip-before-unscale", "exploding-gradients"]
ignore = ["division-by-zero"]
fail-on = "error"
severity = { exploding-gradients = "info" }
exclude = ["experiments/archive/*"]   # globs, relative to pyproject.toml
```

Reading it needs Python 3.11+ (`tomllib`) or the `tomli` package on 3.10.
`exclude` applies to the folders lint walks: a file named on the command line is linted
whatever the globs say (you asked for it), which is how pre-commit calls it, so give the
hook its own `exclude:` (below).

## GitHub code scanning (SARIF)

```yaml
# .github/workflows/nandoctor.yml
name: nandoctor lint
on: [push, pull_request]
jobs:
  lint:
    runs-on: ubuntu-latest
    permissions:
      security-events: write   # upload results
      contents: read
    steps:
      - uses: actions/checkout@v4
      - uses: actions/setup-python@v5
        with: {python-version: "3.11"}
      - run: pip install torch --index-url https://download.pytorch.org/whl/cpu  # small
      - run: pip install nandoctor
      - run: nandoctor lint . --sarif nandoctor.sarif
        continue-on-error: true   # let the upload step run; code scanning shows the findings
      - uses: github/codeql-action/upload-sarif@v3
        with:
          sarif_file: nandoctor.sarif
          category: nandoctor
```

Paths in the SARIF file are relative to the working directory, so run the command from
the repository root. Each rule carries the catalog's explanation and fix as its help text.
A notebook's finding is placed where its code is written in the `.ipynb` file (the line of
its JSON string, as a diff of the file shows it), with the cell and the line in the cell
as the result's `properties` (`notebookCell`, `cellLine`, `cellColumn`).

## pre-commit

`lint` starts in well under a second (it never imports torch), so it can check every
commit. With nandoctor installed in the environment you commit from (the one that has
torch for training), add to `.pre-commit-config.yaml`:

```yaml
repos:
  - repo: local
    hooks:
      - id: nandoctor-lint
        name: nandoctor lint
        entry: nandoctor lint
        language: system          # your environment's nandoctor: no second torch install
        types_or: [python, jupyter]
        exclude: ^experiments/archive/   # a regex: pyproject's `exclude` skips walks only
```

The hook gets the staged `.py` and `.ipynb` files and fails the commit on a finding at
or above `--fail-on` (add `args: [--fail-on, error]` to let warnings through). The same
hook is published in this repository's `.pre-commit-hooks.yaml`, as `id: nandoctor-lint`.
`language: system` on purpose: pre-commit's own `language: python` would install
nandoctor, and with it torch, into an environment of its own.

## Checks

| id | severity | looks for |
|---|---|---|
"""


def render_lint_docs() -> str:
    checks = list(all_checks().values())
    table = "\n".join(f"| [`{c.id}`](#{c.id}) | {_severity(c)} | {c.summary} |" for c in checks)
    return "\n".join([HEADER + table, "", *(render_check(c) for c in checks)])


def render_check(check: Check) -> str:
    cause = check.cause
    lines = [
        f"### {check.id}",
        "",
        f"**{_severity(check)}** · {check.summary} "
        f"See [causes.md](causes.md#{check.id}) for the numbers.",
        "",
        f"{_module_doc(check)}",
        "",
        "Flagged:",
        "",
        *_snippets(check.invalid),
        "Not flagged:",
        "",
        *_snippets(check.valid),
        f"**Fix.** {cause.fix}",
        "",
        f"Suppress: `# nandoctor: ignore[{check.id}]`",
        "",
    ]
    return "\n".join(lines)


def _severity(check: Check) -> str:
    return f"{check.severity} (heuristic)" if check.heuristic else str(check.severity)


def _module_doc(check: Check) -> str:
    """The check module's docstring without its first line (which repeats the summary)."""
    doc = sys.modules[check.run.__module__].__doc__ or ""
    return doc.split("\n", 1)[1].strip() if "\n" in doc else ""


def _snippets(snippets: tuple[str, ...]) -> list[str]:
    lines: list[str] = []
    for snippet in snippets:
        lines += ["```python", snippet.rstrip("\n"), "```", ""]
    return lines


if __name__ == "__main__":
    sys.stdout.write(render_lint_docs())
