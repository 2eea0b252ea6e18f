"""The cause catalog: each cause id of SPEC.md, written once, read by everyone.

Diagnosis rules, `nandoctor lint` and docs/causes.md all take a cause's title,
explanation, fix and before/after snippets from here, so the words a user reads in a
report, in a lint finding and in the docs are the same words. For example::

    >>> get("eps-underflow").title
    'an epsilon that is 0 in float16'

The text itself lives in the cause's own module (`nandoctor/causes/eps_underflow.py`),
beside its rule and fix plan; this is the view over all of them, in the order of
`index.CAUSES`. Ids are stable: add new ones, never rename (SPEC.md, "Cause ids").
Nothing here imports torch.
"""

from __future__ import annotations

from nandoctor.causes.index import CATALOG
from nandoctor.causes.unit import CauseInfo

__all__ = ["CATALOG", "CauseInfo", "get"]


def get(cause_id: str) -> CauseInfo:
    """The catalog entry of `cause_id`; a KeyError names the known ids."""
    try:
        return CATALOG[cause_id]
    except KeyError:
        raise KeyError(f"unknown cause id {cause_id!r}; known: {', '.join(CATALOG)}") from None
