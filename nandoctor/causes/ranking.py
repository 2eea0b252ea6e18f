"""`rank`: run every rule on a case and order the causes that hold, best first.

Several causes can hold at once (a softmax that underflowed in a run whose gradients grew);
the report lists them all with their confidence and evidence, and the what-if engine then
replays the fixes of each. Ties keep the order of `index.CAUSES`.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.index import CATALOG, RULES
from nandoctor.report.types import Cause


def rank(case: Case) -> list[Cause]:
    """Every cause whose rule holds, most confident first."""
    causes = []
    for cause_id, fn in RULES.items():
        hit = fn(case)
        if hit is not None:
            info = CATALOG[cause_id]
            causes.append(
                Cause(cause_id, info.title, round(hit.confidence, 2), hit.evidence, info.fix)
            )
    return sorted(causes, key=lambda c: -c.confidence)
