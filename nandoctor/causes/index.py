"""The one ordered list of causes, and the tables read from it: catalog, rules, fix plans.

`CAUSES` is the order everything follows: `rank` runs the rules in it (so, among causes of
equal confidence, the earlier one ranks first), the catalog and docs/causes.md list the
causes in it. Grouped by what a cause is about; within a group the order is the one the
rules have always run in, since it breaks ranking ties.

Adding a cause: write its module (see `log_of_softmax.py`) and put its `CAUSE` here. The
tables refuse a second entry under one id, so a module copied without changing its id
fails at import.
"""

from __future__ import annotations

from dataclasses import dataclass

from nandoctor.causes import (
    clip_before_unscale,
    division_by_zero,
    eps_underflow,
    exploding_gradients,
    float32_overflow,
    fp16_overflow,
    fp16_without_grad_scaler,
    fully_masked_softmax,
    grad_scaler_collapse,
    invalid_domain,
    learning_rate_too_high,
    log_of_softmax,
    log_of_zero,
    nondifferentiable_point,
    nonfinite_input,
    nonfinite_parameters,
    transient_fault,
)
from nandoctor.causes.unit import CauseInfo, CauseUnit, FixPlan, Rule
from nandoctor.registry import Registry

CAUSES: tuple[CauseUnit, ...] = (
    # the math itself: a log, a division, a root or its derivative met a value outside
    # its domain
    log_of_softmax.CAUSE,
    log_of_zero.CAUSE,
    division_by_zero.CAUSE,
    invalid_domain.CAUSE,
    nondifferentiable_point.CAUSE,
    # the training dynamics, read from the telemetry
    exploding_gradients.CAUSE,
    learning_rate_too_high.CAUSE,
    grad_scaler_collapse.CAUSE,
    # named by the phase alone: the batch, or the weights before the step
    nonfinite_input.CAUSE,
    nonfinite_parameters.CAUSE,
    # the number format: float16's range, an epsilon it rounds to 0, a -inf put in on
    # purpose, float32's range (past which no dtype helps)
    fp16_overflow.CAUSE,
    eps_underflow.CAUSE,
    fully_masked_softmax.CAUSE,
    float32_overflow.CAUSE,
    # the order of the calls: lint in the source, the hooks of a loop they follow
    clip_before_unscale.CAUSE,
    # named by the replay alone: the step, run again from the same state, did not fail
    transient_fault.CAUSE,
    # found by lint only
    fp16_without_grad_scaler.CAUSE,
)


@dataclass(frozen=True)
class Tables:
    """The registries read from a list of causes, each in the list's order."""

    catalog: Registry[CauseInfo]
    rules: Registry[Rule]
    fixes: Registry[FixPlan]


def tables(causes: tuple[CauseUnit, ...]) -> Tables:
    """Register every cause's text, rule and fix plan; a second cause with the same id
    raises `DuplicateError` naming both places in the list."""
    out = Tables(Registry("cause id"), Registry("rule"), Registry("fix plan"))
    for i, unit in enumerate(causes):
        by = f"CAUSES[{i}]" + (f" ({unit.rule.__module__})" if unit.rule is not None else "")
        out.catalog.add(unit.id, unit.info, by=by)
        if unit.rule is not None:
            out.rules.add(unit.id, unit.rule, by=by)
        if unit.fixes:
            out.fixes.add(unit.id, unit.fixes, by=by)
    return out


_TABLES = tables(CAUSES)
CATALOG = _TABLES.catalog  # id -> CauseInfo: the catalog's text
RULES = _TABLES.rules  # id -> Rule, in the order `rank` runs them
FIXES = _TABLES.fixes  # id -> FixPlan, the what-if fixes diagnose/verify.py replays
