"""JUnit XML, the format Jenkins, GitLab and GitHub test reporters read: one test case per
check (the run stayed finite, float16 headroom, each baseline comparison), a failure with
the step, the tensor and the top cause. Written with the standard library's ElementTree.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from nandoctor.causes.words import plural
from nandoctor.report.comparison import Comparison
from nandoctor.report.divergence import divergence_text, divergences
from nandoctor.report.forecast import forecast_text
from nandoctor.report.types import Report


def render_junit(
    report: Report, divergence_fails: bool = False, forecast_fails: bool = False
) -> str:
    """`divergence_fails`: `--fail-on-divergence` was given: the divergence is a test case
    of its own, failed by any divergence event, as the exit code is; `forecast_fails`
    (`--fail-on-forecast`): so is the forecast, failed by any forecast."""
    cases = [_finite_case(report)]
    if report.gate is not None:
        cases += [_case(c.name, c.message, not c.passed) for c in report.gate.checks]
    if divergence_fails:
        cases.append(_divergence_case(report))
    if forecast_fails:
        cases.append(_forecast_case(report))
    seconds = sum(report.timing.values())
    return _document(report.command, report.name or report.config, cases, seconds)


def render_comparison_junit(comparison: Comparison, seconds: float = 0.0) -> str:
    """One case per dtype: it stayed finite, or where it did not; the verdict as details.
    `seconds`: the comparison's wall time (its report records none)."""
    cases = []
    for run in comparison.runs:
        steps = plural(run.steps_completed, "step")
        if run.status == "interrupted":  # NB: nothing went non-finite: not a failure
            cases.append(_case(run.dtype, f"interrupted after {steps}", False, skipped=True))
            continue
        if run.status == "error":  # NB: the user's code ended it: neither finite nor NaN
            cases.append(_case(run.dtype, f"ended by an error after {steps}", False, error=True))
            continue
        failed = run.status != "healthy"
        where = f"non-finite at step {run.first_nonfinite_step}, phase {run.first_nonfinite_phase}"
        message = where if failed else f"{steps} stayed finite"
        cases.append(_case(run.dtype, message, failed, details=comparison.verdict))
    return _document("compare", comparison.name or comparison.config, cases, seconds)


def _document(command: str, run: str, cases: list[ET.Element], seconds: float) -> str:
    suite = ET.Element(
        "testsuite",
        name=f"nandoctor {command}",
        tests=str(len(cases)),
        failures=str(sum(c.find("failure") is not None for c in cases)),
        errors=str(sum(c.find("error") is not None for c in cases)),
        skipped=str(sum(c.find("skipped") is not None for c in cases)),
        time=f"{seconds:.3f}",
    )
    for case in cases:
        case.set("classname", f"nandoctor.{command}.{run}")
        suite.append(case)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _finite_case(report: Report) -> ET.Element:
    first = report.first_nonfinite
    if first is None and report.status == "error":  # NB: the run ended early (exit 3): an
        # error, as the exit code says, never a pass on the steps it ran
        return _case("finite run", report.summary, False, error=True)
    if first is None:  # NB: an interrupted run is not known finite: skipped, not passed
        return _case("finite run", report.summary, False, skipped=report.status == "interrupted")
    message = f"non-finite at step {first.step}, phase {first.phase}"
    if first.tensor:
        message += f": {first.tensor} of {first.op or first.module or 'the run'}"
    if report.causes:
        top = report.causes[0]
        message += f"; top cause {top.id} ({top.confidence:.0%}): {top.fix}"
    return _case("finite run", message, failed=True, details=report.summary)


def _divergence_case(report: Report) -> ET.Element:
    found = divergences(report.events)
    if not found:
        return _case("no divergence", "loss and gradient norm stayed near their level", False)
    message = "; ".join(divergence_text(e) for e in found)
    # NB: the body too (dashboards show it, not the attribute); the run's outcome after it
    return _case("no divergence", message, failed=True, details=f"{message}\n{report.summary}")


def _forecast_case(report: Report) -> ET.Element:
    if not report.forecast:
        return _case("no forecast", "no signal's trend reached its limit", False)
    message = "; ".join(forecast_text(f) for f in report.forecast)
    return _case("no forecast", message, failed=True, details=f"{message}\n{report.summary}")


def _case(
    name: str,
    message: str,
    failed: bool,
    details: str | None = None,
    skipped: bool = False,
    error: bool = False,
) -> ET.Element:
    case = ET.Element("testcase", name=name)
    if error:
        ET.SubElement(case, "error", message=message, type="nandoctor").text = message
    elif failed:
        failure = ET.SubElement(case, "failure", message=message, type="nandoctor")
        failure.text = details or message
    elif skipped:
        ET.SubElement(case, "skipped", message=message)
    else:
        ET.SubElement(case, "system-out").text = message
    return case
