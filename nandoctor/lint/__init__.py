"""`nandoctor lint`: static checks for the training-script mistakes that end in NaN.

Milliseconds per file, no torch import, so it runs in code review before a GPU-day is
spent. Each check is tied to a cause id of SPEC.md and takes its fix from the catalog:

    >>> from nandoctor.lint import lint_text
    >>> [f.id for f in lint_text("import torch\\ny = torch.log(torch.softmax(x, -1))").findings]
    ['log-of-softmax']

Layout: `engine` (read, check, suppress), `checks/` (one module per cause id, registered
in `registry`), the shared analysis they use (`names`: imports; `flow`: what a variable
holds; `patterns`: the torch vocabulary; `scaler`, `fp16`), `config` (pyproject table and
flags), `render/` (terminal, JSON, SARIF) and `docs` (docs/lint.md).
"""

from nandoctor.lint.config import LintConfig, load_config
from nandoctor.lint.engine import lint_paths, lint_text
from nandoctor.lint.findings import Finding, LintResult, Severity, Skipped

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
