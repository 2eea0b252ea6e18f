"""The one report assembly: a `Report` built once from what the engines returned, its
status decided in one place, its notes in a fixed order."""

from __future__ import annotations

import pytest

from nandoctor.diagnose.assemble import Findings, assemble, status_of
from nandoctor.diagnose.summary import NOT_VERIFIED_ON_RANKS, VERIFY_INTERRUPTED
from nandoctor.localize.replay import Localization
from nandoctor.report.types import Cause, Environment
from nandoctor.runtime.record import RunResult

ENV = Environment("cpu", "2.x", "float32", False, 1)


def result(status: str = "healthy", steps: int = 4) -> RunResult:
    return RunResult(status, 0, steps, seconds=1.23456)


@pytest.mark.parametrize(
    ("run_status", "interrupted", "status"),
    [
        ("healthy", False, "healthy"),
        ("timeout", False, "healthy"),  # judged on the steps done
        ("interrupted", False, "interrupted"),
        ("healthy", True, "interrupted"),  # an interrupt in the replay or the fix replays
    ],
)
def test_the_status_of_a_run_nandoctor_drove(run_status, interrupted, status):
    assert status_of(result(run_status), interrupted) == status


@pytest.mark.parametrize(
    ("command_code", "status"), [(0, "healthy"), (130, "interrupted"), (7, "error")]
)
def test_a_watched_command_that_stayed_finite_is_judged_by_its_own_exit_code(command_code, status):
    assert status_of(result(), command_code=command_code) == status


def test_the_report_is_built_from_the_findings_once():
    cause = Cause("fp16-overflow", "overflow", 0.9)
    report = assemble(
        Findings(
            "diagnose",
            "c.yaml",
            ENV,
            result(),
            name="run",
            notes=["driver's note"],
            causes=[cause],
            later_notes=[NOT_VERIFIED_ON_RANKS],
            interrupted=VERIFY_INTERRUPTED,
            verify_seconds=2.0004,
        )
    )
    assert (report.command, report.name, report.status, report.causes) == (
        "diagnose",
        "run",
        "interrupted",
        [cause],
    )
    assert report.notes == ["driver's note", NOT_VERIFIED_ON_RANKS, VERIFY_INTERRUPTED]
    assert report.timing == {"run_s": 1.235, "verify_s": 2.0}
    assert report.summary == "interrupted after 4 steps; no non-finite value seen before"


def test_a_replay_that_saw_nothing_says_so_after_the_drivers_notes():
    located = Localization(3, None, seconds=0.5, note="its last output: done")
    report = assemble(Findings("watch", "python t.py", ENV, result(), notes=["n"], located=located))
    assert report.notes[0] == "n" and "saw no non-finite value" in report.notes[1]
    assert "its last output: done" in report.notes[1]
    assert list(report.timing) == ["run_s", "replay_s"]
    assert report.ranks is None and report.first_nonfinite is None


def test_every_rank_is_listed_in_a_data_parallel_run():
    report = assemble(Findings("diagnose", "c.yaml", ENV, result(), world_size=2))
    assert [(r.rank, r.status) for r in report.ranks] == [(0, "clean"), (1, "clean")]
