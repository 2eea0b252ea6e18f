"""JUnit XML parses back: one case per check, a failure on a NaN run with the step,
the tensor and the top cause."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from nandoctor.render.junit import render_comparison_junit, render_junit
from nandoctor.report.gate import Gate, GateCheck
from nandoctor.report.types import Cause
from tests.render.test_compare import comparison_of
from tests.render.test_terminal import failing_report


def cases(xml: str) -> dict[str, ET.Element]:
    root = ET.fromstring(xml)
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    return suite, {c.get("name"): c for c in suite.findall("testcase")}


def test_a_nan_run_is_one_failing_case_with_step_tensor_and_cause(tmp_path):
    report = failing_report(tmp_path)
    report.causes = [Cause("log-of-softmax", "t", 0.93, [], "use log_softmax")]
    suite, by_name = cases(render_junit(report))
    failure = by_name["finite run"].find("failure")
    assert failure is not None
    message = failure.get("message")
    assert "step 3, phase loss" in message and "output of aten.log.default" in message
    assert "top cause log-of-softmax (93%)" in message
    assert (suite.get("tests"), suite.get("failures")) == ("1", "1")


def test_gate_checks_are_cases(tmp_path):
    report = failing_report(tmp_path)
    report.status, report.first_nonfinite = "healthy", None
    report.gate = Gate(
        "b.json",
        [GateCheck("headroom", True, "peak at 10%"), GateCheck("final loss", False, "worse")],
    )
    suite, by_name = cases(render_junit(report))
    assert set(by_name) == {"finite run", "headroom", "final loss"}
    assert by_name["finite run"].find("failure") is None
    assert by_name["final loss"].find("failure").get("message") == "worse"
    assert suite.get("failures") == "1"


def test_an_interrupted_run_is_skipped_not_passed_nor_failed(tmp_path):
    """Ctrl-C before any NaN: CI must not read the run as finite (it did not finish) nor
    as a NaN (none was seen)."""
    report = failing_report(tmp_path)
    report.status, report.first_nonfinite = "interrupted", None
    suite, by_name = cases(render_junit(report))
    assert by_name["finite run"].find("failure") is None
    assert by_name["finite run"].find("skipped") is not None
    assert (suite.get("failures"), suite.get("skipped")) == ("0", "1")


def test_an_interrupted_comparison_skips_its_unfinished_dtype():
    comparison = comparison_of(("float16", "nonfinite", 7), ("bfloat16", "interrupted", None))
    suite, by_name = cases(render_comparison_junit(comparison))
    assert "step 7, phase loss" in by_name["float16"].find("failure").get("message")
    skipped = by_name["bfloat16"].find("skipped")
    assert skipped is not None and skipped.get("message") == "interrupted after 7 steps"
    assert (suite.get("failures"), suite.get("skipped")) == ("1", "1")


def divergence_at(step: int):
    from nandoctor.report.telemetry import Event

    return Event(kind="divergence", step=step, metric="loss", value=3e6, baseline=2.4)


def test_with_fail_on_divergence_a_diverged_finite_run_fails_its_own_case(tmp_path):
    """The exit code is 1: a JUnit report that read all-passed would contradict it."""
    report = failing_report(tmp_path)
    report.status, report.first_nonfinite = "healthy", None
    report.events = [divergence_at(40)]
    suite, by_name = cases(render_junit(report, divergence_fails=True))
    assert by_name["finite run"].find("failure") is None
    failure = by_name["no divergence"].find("failure")
    assert "loss diverged at step 40" in failure.get("message")
    assert failure.text.startswith(failure.get("message")), "the body says it too"
    assert suite.get("failures") == "1"
    _, by_name = cases(render_junit(report))  # information only, without the flag
    assert set(by_name) == {"finite run"}


def test_with_fail_on_divergence_a_steady_run_passes_the_divergence_case(tmp_path):
    report = failing_report(tmp_path)
    report.status, report.first_nonfinite, report.events = "healthy", None, []
    suite, by_name = cases(render_junit(report, divergence_fails=True))
    assert by_name["no divergence"].find("failure") is None
    assert (suite.get("tests"), suite.get("failures")) == ("2", "0")


def test_a_run_the_users_code_ended_is_an_error_not_a_pass(tmp_path):
    """`sys.exit` in the loss at step 5 (exit 3): the dashboard must not show green."""
    report = failing_report(tmp_path)
    report.status, report.first_nonfinite = "error", None
    suite, by_name = cases(render_junit(report))
    assert by_name["finite run"].find("error") is not None
    assert by_name["finite run"].find("system-out") is None
    assert (suite.get("errors"), suite.get("failures")) == ("1", "0")


def test_a_comparison_whose_dtype_ended_in_an_error_says_so():
    comparison = comparison_of(("float16", "error", None), ("bfloat16", "healthy", None))
    suite, by_name = cases(render_comparison_junit(comparison))
    assert by_name["float16"].find("error") is not None
    assert (suite.get("errors"), suite.get("failures")) == ("1", "0")
