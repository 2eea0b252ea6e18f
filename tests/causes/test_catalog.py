"""The cause catalog: every SPEC.md id, once, complete, and docs/causes.md in sync, with a
row per id in its table of rules, what-if fixes, math patches and lint checks."""

from __future__ import annotations

import ast

import pytest

from nandoctor.causes.catalog import CATALOG, CauseInfo, get
from nandoctor.causes.unit import entry
from nandoctor.docgen.causes import coverage, render_causes
from nandoctor.registry import DuplicateError
from tests.helpers.paths import REPO

# SPEC.md, "Cause ids": stable, added to and never renamed. Copied here on purpose: CI has
# no access to the design folder, and a rename must fail this test.
SPEC_IDS = (
    "log-of-softmax",
    "log-of-zero",
    "fp16-overflow",
    "exploding-gradients",
    "learning-rate-too-high",
    "nonfinite-input",
    "nonfinite-parameters",
    "division-by-zero",
    "nondifferentiable-point",
    "fully-masked-softmax",
    "eps-underflow",
    "grad-scaler-collapse",
    "invalid-domain",
    "clip-before-unscale",
    "fp16-without-grad-scaler",
    "float32-overflow",  # added after SPEC.md's table, as its rule allows
    "transient-fault",
)


def test_every_spec_id_has_an_entry_and_nothing_else_does():
    assert set(CATALOG) == set(SPEC_IDS)
    assert len(CATALOG) == len(SPEC_IDS)


@pytest.mark.parametrize("cause_id", SPEC_IDS)
def test_entries_are_complete(cause_id):
    info = get(cause_id)
    assert info.id == cause_id
    for field in ("title", "explanation", "fix", "before", "after"):
        assert getattr(info, field).strip(), f"{cause_id}.{field} is empty"
    assert info.before != info.after
    assert len(info.title) <= 60, "titles are short"
    assert 2 <= info.explanation.count(". ") + 1 <= 6, "explanations run 2-4 sentences"


@pytest.mark.parametrize("cause_id", SPEC_IDS)
def test_snippets_are_python(cause_id):
    info = get(cause_id)
    for snippet in (info.before, info.after):
        ast.parse(snippet)
        compile(snippet, f"<{cause_id}>", "exec")


def test_entries_are_frozen():
    with pytest.raises(AttributeError):
        get("eps-underflow").fix = "anything"  # type: ignore[misc]


def test_a_duplicate_id_is_refused():
    with pytest.raises(DuplicateError, match="cause id 'log-of-softmax' is registered twice"):
        CATALOG.add("log-of-softmax", entry("log-of-softmax", "t", "e", "f", "b = 1", "a = 1"), "x")
    assert isinstance(CATALOG["log-of-softmax"], CauseInfo)
    assert CATALOG["log-of-softmax"].title != "t"


def test_an_unknown_id_names_the_known_ones():
    with pytest.raises(KeyError, match="log-of-softmax"):
        get("log-softmax")


def test_fp16_overflow_explains_bfloat16():
    text = get("fp16-overflow").explanation
    for fact in ("65504", "3.4e38", "8 exponent bits", "5 exponent bits", "8 significand", "11"):
        assert fact in text


def test_exploding_gradients_unscales_before_clipping():
    after = get("exploding-gradients").after
    assert after.index("scaler.unscale_(opt)") < after.index("clip_grad_norm_")


def test_log_of_softmax_shows_the_fused_ops():
    after = get("log-of-softmax").after
    assert "F.cross_entropy" in after
    assert "F.log_softmax" in after


def test_numbers_practitioners_check():
    assert "6e-8" in get("eps-underflow").explanation
    assert "exp(-18)" in get("log-of-softmax").explanation
    assert "65536" in get("clip-before-unscale").explanation
    no_scaler = get("fp16-without-grad-scaler").explanation
    for number in ("6.0e-8", "6.1e-5", "65504", "inf by inf", "65536", "3.4e38"):
        assert number in no_scaler


def test_committed_causes_md_is_generated_from_the_catalog():
    committed = (REPO / "docs" / "causes.md").read_text(encoding="utf-8")
    assert committed == render_causes(), "run: python -m nandoctor.docgen.causes > docs/causes.md"


def test_causes_md_has_a_section_per_id():
    text = render_causes()
    for cause_id in SPEC_IDS:
        assert f"\n## {cause_id}\n" in text


def test_every_spec_id_has_a_row_in_the_table():
    assert [row.id for row in coverage()] == list(CATALOG)
    table = render_causes().split("\n## ", 1)[0]
    for cause_id in SPEC_IDS:
        (row,) = [line for line in table.splitlines() if line.startswith(f"| [`{cause_id}`]")]
        assert row.count(" | ") == 5, row  # id, cause, rule, what-if, patch, lint


def test_the_table_is_read_from_the_registries():
    rows = {row.id: row for row in coverage()}
    assert rows["log-of-softmax"].rule == "`log_of_softmax`"
    assert rows["log-of-softmax"].patch.startswith("`LogSoftmaxPatch`: log_softmax(x)")
    assert rows["log-of-softmax"].lint == "[error](lint.md#log-of-softmax)"
    assert rows["fp16-overflow"].whatif == "bfloat16 autocast instead of float16"
    assert rows["eps-underflow"].whatif.startswith("in the optimizer phase: the optimizer's eps")
    assert rows["eps-underflow"].whatif.endswith(
        "; then the math patch; then the origin op guarded"
    )
    assert rows["division-by-zero"].whatif == "the origin op guarded"
    assert rows["division-by-zero"].patch.startswith("`OriginGuardPatch`: the op the replay named")
    clip = rows["clip-before-unscale"]  # lint, and the hooks: a rule, nothing to replay
    assert clip.rule == "`clip_before_unscale`" and (clip.whatif, clip.patch) == (None, None)
    assert clip.lint
    no_scaler = rows["fp16-without-grad-scaler"]  # lint only
    assert (no_scaler.rule, no_scaler.whatif, no_scaler.patch) == (None, None, None)
    assert no_scaler.lint == "[warning](lint.md#fp16-without-grad-scaler)"
    zeroed = rows["nonfinite-parameters"]  # a rule, a config-side what-if, nothing to lint
    assert zeroed.whatif == "the non-finite entries of the loaded weights zeroed"
    assert zeroed.rule and (zeroed.patch, zeroed.lint) == (None, None)
