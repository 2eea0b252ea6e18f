"""A cause is a unit: one module per id holding its text, rule and fix plan, gathered in one
ordered list whose tables refuse a second entry under one id."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

import nandoctor.causes
from nandoctor.causes.index import CATALOG, CAUSES, FIXES, RULES, tables
from nandoctor.causes.unit import CauseUnit, Change, Fix, entry, fix_for
from nandoctor.registry import DuplicateError, Registry


def cause_modules() -> dict[str, object]:
    """Every module of nandoctor/causes/ that declares a `CAUSE`, by module name."""
    found = {}
    for info in pkgutil.iter_modules(nandoctor.causes.__path__):
        module = importlib.import_module(f"nandoctor.causes.{info.name}")
        if isinstance(getattr(module, "CAUSE", None), CauseUnit):
            found[info.name] = module
    return found


def test_one_module_per_cause_id_and_every_one_in_the_list():
    modules = cause_modules()
    assert sorted(modules) == sorted(unit.id.replace("-", "_") for unit in CAUSES)
    for name, module in modules.items():
        assert module.CAUSE.id.replace("-", "_") == name
        assert module.CAUSE in CAUSES, f"{name}.CAUSE is missing from causes.index.CAUSES"


def test_a_rule_lives_in_its_cause_module():
    for unit in CAUSES:
        if unit.rule is not None:
            assert unit.rule.__module__ == f"nandoctor.causes.{unit.id.replace('-', '_')}"


def test_the_tables_follow_the_list():
    ids = [unit.id for unit in CAUSES]
    assert list(CATALOG) == ids
    assert list(RULES) == [unit.id for unit in CAUSES if unit.rule is not None]
    assert list(FIXES) == [unit.id for unit in CAUSES if unit.fixes]


def test_ranking_ties_keep_the_order_rules_have_always_run_in():
    # NB: ties among equally confident causes break by this order: changing it changes reports
    assert list(RULES) == [
        "log-of-softmax",
        "log-of-zero",
        "division-by-zero",
        "invalid-domain",
        "nondifferentiable-point",
        "exploding-gradients",
        "learning-rate-too-high",
        "grad-scaler-collapse",
        "nonfinite-input",
        "nonfinite-parameters",
        "fp16-overflow",
        "eps-underflow",
        "fully-masked-softmax",
        "float32-overflow",
        "clip-before-unscale",  # new rules go last: the older ties keep their order
        "transient-fault",
    ]


def test_a_copied_cause_module_is_refused_naming_both_places():
    first = CAUSES[0]
    copy = CauseUnit(first.info, rule=first.rule, fixes=first.fixes)
    with pytest.raises(DuplicateError) as raised:
        tables((first, CAUSES[1], copy))
    message = str(raised.value)
    assert "cause id 'log-of-softmax' is registered twice" in message
    assert "CAUSES[0]" in message and "CAUSES[2]" in message


def test_a_registry_refuses_a_second_item_under_a_name():
    rules = Registry[int]("rule")
    rules.add("a", 1, by="first.py")
    with pytest.raises(DuplicateError, match=r"first by first\.py, again by second\.py"):
        rules.add("a", 2, by="second.py")
    assert rules["a"] == 1 and rules.registered_by("a") == "first.py"
    assert isinstance(DuplicateError("x"), ValueError)


def test_a_fix_must_do_something():
    with pytest.raises(ValueError, match="changes the config, patches the math, or guards"):
        Fix()
    with pytest.raises(ValueError, match="the guard of the origin op is a fix on its own"):
        Fix(Change.BFLOAT16, guard=True)


def test_the_fix_replayed_depends_on_the_phase():
    plan = FIXES["eps-underflow"]
    assert fix_for(plan, "optimizer").change is Change.OPTIMIZER_EPS
    assert fix_for(plan, "forward").patch and fix_for(plan, "forward").change is None
    assert fix_for((Fix(Change.BFLOAT16, phases=frozenset({"backward"})),), "forward") is None


def test_entry_joins_prose_and_dedents_snippets():
    info = entry("x", "t", "\n    one\n    two\n", "f", "\n    a = 1\n", "\n    b = 2\n")
    assert (info.explanation, info.before, info.after) == ("one two", "a = 1", "b = 2")


def test_the_causes_do_not_import_torch():
    code = (
        "import sys; import nandoctor.causes.index, nandoctor.causes.ranking, "
        "nandoctor.causes.catalog; assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
