"""Why a run went non-finite: one module per cause id of SPEC.md, and the ranking.

Each cause module (`log_of_softmax.py`, ...) holds everything about its cause as one
`CauseUnit` (unit.py): the catalog text users read in reports, lint findings and
docs/causes.md, the rule that recognises it in a `Case` (case.py), and its fix plan, the
what-if fixes nandoctor replays to verify it, declared as data. `index.CAUSES` is the one
ordered list of them, and the catalog, rule and fix tables are read from it; `ranking.rank`
runs the rules; `words.py` holds what the rules share.

Adding a cause: add its id to SPEC.md and tests/causes/test_catalog.py; write its module (text,
rule, `FIXES`, `CAUSE`); put its `CAUSE` in `index.CAUSES`; if it has a fix nandoctor can
apply, name a `Change` (and teach diagnose/plans.py to apply a new one) or register a
math patch for the id in runtime/patches.py; a lint check goes in lint/checks/; then
regenerate docs/causes.md (`python -m nandoctor.docgen.causes > docs/causes.md`).

This package init imports nothing on purpose, and nothing here imports torch: `lint` reads
the catalog and must not pay for it.
"""
