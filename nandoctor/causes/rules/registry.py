"""The registry the rules join, `rank` that runs them, and the words they share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nandoctor.causes import catalog
from nandoctor.causes.case import Case
from nandoctor.report.types import Cause

LOGS = frozenset({"log", "log2", "log10"})
PROBABILITIES = frozenset({"softmax", "sigmoid"})
SOFTMAXES = frozenset({"softmax", "log_softmax"})
ROOTS = frozenset({"sqrt", "rsqrt"})
STEEP_AT_A_POINT = frozenset(
    {"sqrt", "rsqrt", "pow", "norm", "linalg_vector_norm", "acos", "asin", "cdist", "dist", "std"}
)  # ops whose derivative is infinite at a point where the op itself is finite


@dataclass(frozen=True)
class Hit:
    confidence: float
    evidence: list[str]


Rule = Callable[[Case], Hit | None]
RULES: dict[str, Rule] = {}


def rule(cause_id: str) -> Callable[[Rule], Rule]:
    """Register a rule under a cause id of the catalog; one rule per id."""

    def register(fn: Rule) -> Rule:
        if cause_id in RULES:
            raise ValueError(f"a rule for {cause_id!r} is registered twice")
        catalog.get(cause_id)  # refuses an id the catalog does not know
        RULES[cause_id] = fn
        return fn

    return register


def rank(case: Case) -> list[Cause]:
    """Every cause whose rule holds, most confident first."""
    causes = []
    for cause_id, fn in RULES.items():
        hit = fn(case)
        if hit is not None:
            info = catalog.get(cause_id)
            causes.append(
                Cause(cause_id, info.title, round(hit.confidence, 2), hit.evidence, info.fix)
            )
    return sorted(causes, key=lambda c: -c.confidence)


def where(case: Case) -> str:
    where = f" in {case.first.module or '(root)'}" if case.first.module is not None else ""
    return where + (f" at {case.first.source}" if case.first.source else "")


def num(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


def number_in(scalar: str) -> float:
    """The number of a scalar argument as the tracer wrote it: "other=1e-08" -> 1e-08."""
    try:
        return float(scalar.split("=", 1)[-1])
    except ValueError:
        return 0.0
