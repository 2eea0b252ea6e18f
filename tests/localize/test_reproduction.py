"""Reproduced, or transient: the replay of the failing step, from the state the run had
before it, holds its losses against the run's, bit for bit. The same loop under `watch`
(a rerun of the script) and under `Guard` (the step function called again): a failure
that comes back exactly (`exact`), one that comes back with other values
(`values-differ`: noise the run drew from outside its seeded generators), and a bit
flipped on the first run of the step only (`not-reproduced`, cause `transient-fault`).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import nandoctor
import nandoctor.cli.watch  # registers the command until cli/__init__ imports it
from nandoctor.cli import app
from nandoctor.localize.replay import Localization
from nandoctor.localize.reproduction import mean_losses, reproduction
from nandoctor.localize.tracer import Sighting
from nandoctor.render.markdown import render_markdown
from nandoctor.runtime.probe import Phase
from tests.scripts import flaky_step
from tests.scripts.expected import SCRIPTS

SCRIPT = str(SCRIPTS / "flaky_step.py")
FOUND = Sighting(Phase.LOSS, None, "aten.log.default", "output", "nan", "float32", [], 1, None)


# -- what "exact" compares ---------------------------------------------------------------------
def test_exact_is_every_recomputed_loss_equal_to_the_runs_nan_for_nan():
    run = {1: 2.5, 2: 2.25, 3: math.nan}
    located = Localization(3, FOUND, losses={2: 2.25, 3: math.nan})
    assert reproduction(located, run).word == "exact"
    differ = reproduction(Localization(3, FOUND, losses={2: 2.2500001, 3: math.nan}), run)
    assert (differ.word, differ.step, differ.run, differ.replay) == (
        "values-differ",
        2,
        2.25,
        2.2500001,
    )
    inf = reproduction(Localization(3, FOUND, losses={3: math.inf}), run)
    assert inf.word == "values-differ"  # NaN in the run, inf in the replay


def test_a_replay_that_met_nothing_did_not_reproduce_one_that_never_ran_says_nothing():
    assert reproduction(Localization(3, None), {}).word == "not-reproduced"
    off = reproduction(Localization(3, None, losses={2: 2.0, 3: 1.0}), {2: 2.5, 3: 1.0})
    assert (off.word, off.step) == ("not-reproduced", 2)  # and it left the run's path first
    assert reproduction(Localization(3, None, reached=False), {}) is None  # ended before it
    assert reproduction(Localization(3, None, failed=True), {}) is None  # out of memory, ...
    assert reproduction(None, {}) is None  # nothing replayed


def test_a_data_parallel_replay_is_held_as_the_ranks_mean_as_the_run_keeps_it():
    assert mean_losses([{2: 1.0, 3: 4.0}, {2: 3.0, 3: 2.0, 4: 9.0}]) == {2: 2.0, 3: 3.0}


# -- under watch: the script run again ---------------------------------------------------------
def watch(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "report.json"
    command = ["watch", "--json", str(out), "-q", "--", sys.executable, SCRIPT, *args]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 1, result.output
    return json.loads(out.read_text())


def test_watch_a_deterministic_failure_reproduces_exactly(tmp_path):
    report = watch(tmp_path, "exact")
    first = report["first_nonfinite"]
    assert (first["step"], first["phase"], first["reproduced"]) == (3, "backward", "exact")
    assert report["causes"][0]["id"] == "nondifferentiable-point"
    assert not any("values" in note or "did not reproduce" in note for note in report["notes"])


def test_watch_a_failure_with_run_dependent_noise_reproduces_with_other_values(tmp_path):
    report = watch(tmp_path, "noisy")
    first = report["first_nonfinite"]
    assert (first["step"], first["phase"], first["reproduced"]) == (3, "backward", "values-differ")
    assert report["causes"][0]["id"] == "nondifferentiable-point"  # the origin is still named
    (note,) = [n for n in report["notes"] if "with other values" in n]
    assert note.startswith("the instrumented replay of step 3 went non-finite as the run did")


def test_watch_a_bit_flipped_on_the_first_run_only_is_a_transient_fault(tmp_path):
    report = watch(tmp_path, "bitflip", str(tmp_path / "flipped"))
    first = report["first_nonfinite"]
    assert (first["step"], first["reproduced"], first["op"]) == (3, "not-reproduced", None)
    (cause,) = report["causes"]
    assert cause["id"] == "transient-fault" and cause["verified"] is None
    assert cause["evidence"] == [
        "the replay of step 3, from the same weights, batch and random state, met no "
        "non-finite value: the failure did not reproduce"
    ]
    assert any("did not reproduce (reproduced: not-reproduced)" in n for n in report["notes"])


# -- under Guard: the step function called again ----------------------------------------------
def guarded(mode: str):
    calls = {"flipped": False}

    def flipped() -> bool:  # NB: this process's first run of the step flips, no later one
        already, calls["flipped"] = calls["flipped"], True
        return already

    model, optimizer, data, train_step = flaky_step.make(mode, flipped)
    guard = nandoctor.Guard(model, optimizer)
    with pytest.raises(nandoctor.NonFiniteError) as caught:
        for step, batch in enumerate(data):
            guard.step(train_step, step, batch)
    return caught.value.report


@pytest.mark.parametrize(
    ("mode", "word", "top"),
    [
        ("exact", "exact", "nondifferentiable-point"),
        ("noisy", "values-differ", "nondifferentiable-point"),
        ("bitflip", "not-reproduced", "transient-fault"),
    ],
)
def test_guard_tells_the_three_apart(mode, word, top):
    report = guarded(mode)
    first = report.first_nonfinite
    assert (first.step, first.reproduced) == (3, word)
    assert report.causes[0].id == top
    if word == "values-differ":
        note = next(n for n in report.notes if "with other values" in n)
        assert "(reproduced: values-differ)" in note
    markdown = render_markdown(report)
    expected = {
        "exact": "| reproduced | `exact` |",
        "values-differ": "| reproduced | `yes, with other values (nondeterministic)` |",
        "not-reproduced": (
            "| reproduced | `no: transient (the hardware, a race, or nondeterminism)` |"
        ),
    }
    assert expected[word] in markdown
