"""`nandoctor lint`: static checks for the training-script mistakes that end in NaN.

Milliseconds per file, no torch import, so it runs in code review before a GPU-day is
spent. Each check is tied to a cause id of SPEC.md and takes its fix from the catalog:

    >>> from nandoctor.lint import lint_text
    >>> [f.id for f in lint_text("import torch\\ny = torch.log(torch.softmax(x, -1))").findings]
    ['log-of-softmax']

Layout: `engine` (read, check, suppress), `checks/` (one module per cause id, each a
`unit.Check`, listed in order in `registry`), the shared analysis they use (`names`:
imports; `flow`: what a variable holds; `patterns`: the torch vocabulary; `scaler`,
`fp16`), `config` (pyproject table and flags), `render/` (terminal, JSON, SARIF) and `docs`
(docs/lint.md).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nandoctor.lint.config import LintConfig, load_config
    from nandoctor.lint.engine import lint_paths, lint_text
    from nandoctor.lint.findings import Finding, LintResult, Severity, Skipped

# NB: loaded on first use (PEP 562): the CLI imports `findings` for its options, and
# every other command would otherwise load the whole engine with it
_HOMES = {
    "Finding": "findings",
    "LintConfig": "config",
    "LintResult": "findings",
    "Severity": "findings",
    "Skipped": "findings",
    "lint_paths": "engine",
    "lint_text": "engine",
    "load_config": "config",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)


__all__ = [
    "Finding",
    "LintConfig",
    "LintResult",
    "Severity",
    "Skipped",
    "lint_paths",
    "lint_text",
    "load_config",
]
