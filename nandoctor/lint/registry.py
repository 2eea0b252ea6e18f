"""The one ordered table of lint checks, written out, as causes/index.py is for causes.

`CHECKS` is the order everything follows: the engine runs the checks in it, and
docs/lint.md and SARIF's rule list show them in it: errors first, heuristics last. It is
one explicit list, as ruff's codes.rs maps each code to its rule, so nothing registers
itself by being imported, and the table can be read in one place.

Adding a check: write its module in checks/ (see `log_of_zero.py`), ending in
`CHECK = Check(...)`, and put that `CHECK` here. The table refuses an id the cause catalog
lacks, and a second check under one id, so a module copied without changing its id fails
at import.
"""

from __future__ import annotations

from collections.abc import Iterable

from nandoctor.causes import catalog
from nandoctor.lint.checks import (
    clip_before_unscale,
    division_by_zero,
    eps_underflow,
    exploding_gradients,
    fp16_without_grad_scaler,
    fully_masked_softmax,
    log_of_softmax,
    log_of_zero,
    nondifferentiable_point,
)
from nandoctor.lint.unit import Check
from nandoctor.registry import Registry

CHECKS: tuple[Check, ...] = (
    # errors: a NaN or inf follows whenever the code runs
    log_of_softmax.CHECK,
    log_of_zero.CHECK,
    clip_before_unscale.CHECK,
    # warnings: a NaN follows with some inputs, dtypes or gradients
    exploding_gradients.CHECK,
    fp16_without_grad_scaler.CHECK,
    fully_masked_softmax.CHECK,
    eps_underflow.CHECK,
    # heuristics: patterns that are often fine
    nondifferentiable_point.CHECK,
    division_by_zero.CHECK,
)


def table(checks: Iterable[Check]) -> Registry[Check]:
    """The checks by id, in the given order. An id the cause catalog lacks raises
    `KeyError`; a second check under one id raises `DuplicateError` (a ValueError) naming
    both places in the list."""
    out: Registry[Check] = Registry("lint check")
    for i, check in enumerate(checks):
        catalog.get(check.id)  # NB: every check explains itself with its cause's text
        out.add(check.id, check, by=f"CHECKS[{i}] ({check.run.__module__})")
    return out


TABLE = table(CHECKS)


def all_checks() -> dict[str, Check]:
    """Every check, by id, in the order of `CHECKS`."""
    return dict(TABLE)
