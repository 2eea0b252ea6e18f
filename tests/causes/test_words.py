"""The sentences people read say what was seen, in words that agree with their numbers:
no "1 steps", no "value(s)", no "None None value(s) in None"."""

from __future__ import annotations

import re

import pytest

from nandoctor.causes.words import plural, values
from nandoctor.diagnose.summary import summarize
from nandoctor.report.telemetry import Event
from nandoctor.runtime.judge import Judge
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.verdict import Reading
from tests.helpers.paths import REPO

SENTENCES = [
    REPO / "nandoctor" / "diagnose" / "summary.py",
    REPO / "nandoctor" / "diagnose" / "verify.py",
    REPO / "nandoctor" / "diagnose" / "learning.py",
    *sorted((REPO / "nandoctor" / "causes").glob("*.py")),
    *sorted((REPO / "nandoctor" / "render").glob("*.py")),
]


@pytest.mark.parametrize("path", SENTENCES, ids=lambda p: p.name)
def test_no_sentence_hedges_its_plural(path):
    text = path.read_text()
    hedged = re.findall(r"\b(?:value|zero|step|skip|NaN|time|row|op)\(s\)", text)
    assert not hedged, path  # "value(s)": say 1 value, 2 values


def test_counts_and_their_nouns_agree():
    assert [plural(n, "step") for n in (0, 1, 14)] == ["0 steps", "1 step", "14 steps"]
    assert plural(None, "exact zero") == "some exact zeros"
    assert values(1, "nan") == "1 NaN value" and values(192, "mixed") == "192 non-finite values"
    assert values(None, None) == "non-finite values"


def test_a_run_of_one_step_is_one_step():
    assert summarize("healthy", RunResult("healthy", 0, 1)) == "the run's one step stayed finite"
    assert summarize("healthy", RunResult("healthy", 0, 2)) == "all 2 steps stayed finite"
    stopped = RunResult("interrupted", 0, 1)
    assert summarize("interrupted", stopped).startswith("interrupted after 1 step;")


def test_a_finite_run_that_diverged_says_so_in_its_summary_whatever_ended_it():
    """The summary is what `-q` and a CI log show first: "healthy" alone read as a run
    that trained, of one whose loss went 100x up (a watched script that then crashed
    printing exp(loss) said only that it exited with code 1)."""
    loss = Event(1, "divergence", metric="loss", value=1.3e4, baseline=9.1)
    norm = Event(4, "divergence", metric="grad_norm", value=300.0, baseline=0.8)
    ran = RunResult("healthy", 0, 85)
    assert summarize("healthy", ran, events=[loss]) == (
        "all 85 steps stayed finite, but the loss diverged at step 1"
    )
    assert summarize("error", ran, command_code=1, events=[loss, norm]) == (
        "the command exited with code 1 after 85 finite steps, but the loss diverged at "
        "step 1 and the gradient norm diverged at step 4"
    )
    skip = Event(2, "scaler-skip", 1024.0, reason="overflow")
    assert summarize("healthy", ran, events=[skip]) == "all 85 steps stayed finite"


def test_a_collapse_after_one_skip_is_not_one_steps():
    judge = Judge(min_scale=1.0)
    bad = Reading(3, False, False, False, False, True, False, 1.0, 1.0, scale=1.5)
    verdict = judge(bad)
    assert verdict.failed and "1 steps" not in verdict.why
    assert verdict.why.startswith("the GradScaler skipped step 3 at loss scale 1.5")
