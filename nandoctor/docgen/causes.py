"""docs/causes.md, generated from the cause modules and the registries, so they cannot drift.

    python -m nandoctor.docgen.causes > docs/causes.md

The table at the top is read from the registries, never written by hand: the rules and the
fix plans (`causes.index`), the math patches (`runtime.patches.PATCHES`) and the lint checks
(`lint.registry`). tests/causes/test_catalog.py fails when the committed file differs from
`render_causes()`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from nandoctor.causes.index import CAUSES, FIXES, RULES
from nandoctor.causes.unit import CauseInfo, FixPlan
from nandoctor.lint.registry import all_checks
from nandoctor.runtime.patches import PATCHES, MathPatch, OriginGuardPatch

HEADER = """\
<!-- Generated from nandoctor/causes/ (one module per cause id) and the registries of rules,
     fixes, math patches and lint checks by `python -m nandoctor.docgen.causes > docs/causes.md`:
     edit the cause modules, not this file. -->

# Causes of non-finite values

Every cause that `nandoctor diagnose` ranks and `nandoctor lint` checks for has a stable id,
the same in the JSON report, the SARIF output and the suppression comments
(`# nandoctor: ignore[<id>]`). Each section says why the cause produces inf or NaN, what to
do about it, and shows the code before and after.

Numbers worth remembering: float16 tops out at **65504** and its smallest positive value (a
subnormal) is **2\\*\\*-24 ~ 6e-8**, so `exp(-18)` and `1e-8` are exactly 0 there; bfloat16
reaches **~3.4e38** with 8 significand bits; float32 underflows below ~1.4e-45.

What nandoctor has for each cause: the **rule** that recognises it in a diagnosed run (in
`nandoctor/causes/<id>.py`), the **what-if** fix it replays to verify the cause (see
[diagnosis.md](diagnosis.md#what-if-verification)), the **math patch** that replay applies
when the fix is a change to the math rather than the config, and the **lint** check that
finds it in the source (see [lint.md](lint.md)). The table is read from the registries.
"""

EMPTY_CELL = "—"


@dataclass(frozen=True)
class Coverage:
    """One row of the table: what nandoctor has for one cause id (None: nothing)."""

    id: str
    title: str
    rule: str | None
    whatif: str | None
    patch: str | None
    lint: str | None


def coverage() -> list[Coverage]:
    """Every cause id, in the order of `causes.index.CAUSES`, read from the registries."""
    checks = all_checks()
    rows = []
    for unit in CAUSES:
        rule = RULES.get(unit.id)
        patch = PATCHES.get(unit.id)
        check = checks.get(unit.id)
        rows.append(
            Coverage(
                id=unit.id,
                title=unit.info.title,
                rule=f"`{rule.__name__}`" if rule else None,
                whatif=_fixes(FIXES[unit.id]) if unit.id in FIXES else None,
                patch=_patches(patch, FIXES.get(unit.id, ())),
                lint=_lint(unit.id, check.severity, check.heuristic) if check else None,
            )
        )
    return rows


def _fixes(plan: FixPlan) -> str:
    """ "a 10x smaller learning rate"; "in the optimizer phase: ...; then the math patch":
    the fixes in the order they are replayed, each until one holds."""
    parts = []
    for i, fix in enumerate(plan):
        what = [fix.change.value] if fix.change is not None else []
        what += ["the math patch"] if fix.patch else []
        what += [GUARD] if fix.guard else []
        when = f"in the {' or '.join(sorted(fix.phases))} phase: " if fix.phases else ""
        parts.append(("then " if i else "") + when + " and ".join(what))
    return "; ".join(parts)


GUARD = "the origin op guarded"


def _patches(patch: type[MathPatch] | None, plan: FixPlan) -> str | None:
    """The cause's own math patch, and the guard of the origin op when its plan uses it."""
    cells = [f"`{patch.__name__}`: {patch.describe}"] if patch else []
    if any(fix.guard for fix in plan):
        cells.append(f"`{OriginGuardPatch.__name__}`: {GUARD_WORDS}")
    return "; ".join(cells) or None


GUARD_WORDS = (
    "the op the replay named, at its source line, made safe "
    "([how](diagnosis.md#guarding-the-origin-op))"
)


def _lint(cause_id: str, severity: object, heuristic: bool) -> str:
    kind = f"{severity} (heuristic)" if heuristic else str(severity)
    return f"[{kind}](lint.md#{cause_id})"


def render_causes() -> str:
    """The whole of docs/causes.md."""
    units = [unit.info for unit in CAUSES]
    return "\n".join([HEADER, render_table(coverage()), *(render_cause(i) for i in units)])


def render_table(rows: list[Coverage]) -> str:
    lines = ["| id | cause | rule | what-if fix | math patch | lint |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r.rule, r.whatif, r.patch, r.lint]
        lines.append(
            f"| [`{r.id}`](#{r.id}) | {r.title} | "
            + " | ".join(c or EMPTY_CELL for c in cells)
            + " |"
        )
    return "\n".join([*lines, ""])


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
