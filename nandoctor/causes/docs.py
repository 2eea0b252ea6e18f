"""docs/causes.md, generated from the catalog so that the two cannot drift apart.

    python -m nandoctor.causes.docs > docs/causes.md

tests/test_catalog.py fails when the committed file differs from `render_causes()`.
"""

from __future__ import annotations

import sys

from nandoctor.causes.catalog import CATALOG, CauseInfo

HEADER = """\
<!-- Generated from nandoctor/causes/catalog.py by
     `python -m nandoctor.causes.docs > docs/causes.md`: edit the catalog, not this file. -->

# Causes of non-finite values

Every cause that `nandoctor diagnose` ranks and `nandoctor lint` checks for has a stable id,
the same in the JSON report, the SARIF output and the suppression comments
(`# nandoctor: ignore[<id>]`). Each section says why the cause produces inf or NaN, what to
do about it, and shows the code before and after.

Numbers worth remembering: float16 tops out at **65504** and its smallest positive value (a
subnormal) is **2\\*\\*-24 ~ 6e-8**, so `exp(-18)` and `1e-8` are exactly 0 there; bfloat16
reaches **~3.4e38** with 8 significand bits; float32 underflows below ~1.4e-45.
"""


def render_causes() -> str:
    """The whole of docs/causes.md."""
    parts = [HEADER, render_index(), *(render_cause(info) for info in CATALOG.values())]
    return "\n".join(parts)


def render_index() -> str:
    rows = [f"| [`{c.id}`](#{c.id}) | {c.title} |" for c in CATALOG.values()]
    return "\n".join(["| id | cause |", "|---|---|", *rows, ""])


def render_cause(info: CauseInfo) -> str:
    return "\n".join(
        [
            f"## {info.id}",
            "",
            f"**{info.title[0].upper()}{info.title[1:]}.** {info.explanation}",
            "",
            f"**Fix.** {info.fix}",
            "",
            "Before:",
            "",
            "```python",
            info.before,
            "```",
            "",
            "After:",
            "",
            "```python",
            info.after,
            "```",
            "",
        ]
    )


if __name__ == "__main__":
    sys.stdout.write(render_causes())
