"""JUnit XML, the format Jenkins, GitLab and GitHub test reporters read: one test case per
check (the run stayed finite, float16 headroom, each baseline comparison), a failure with
the step, the tensor and the top cause. Written with the standard library's ElementTree.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from nandoctor.report import Report


def render_junit(report: Report) -> str:
    cases = [_finite_case(report)]
    if report.gate is not None:
        cases += [
            _case(check.name, check.message, not check.passed) for check in report.gate.checks
        ]
    suite = ET.Element(
        "testsuite",
        name=f"nandoctor {report.command}",
        tests=str(len(cases)),
        failures=str(sum(c.find("failure") is not None for c in cases)),
        errors="0",
        time=f"{sum(report.timing.values()):.3f}",
    )
    for case in cases:
        case.set("classname", f"nandoctor.{report.command}.{report.name or report.config}")
        suite.append(case)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def _finite_case(report: Report) -> ET.Element:
    first = report.first_nonfinite
    if first is None:
        return _case("finite run", report.summary, failed=False)
    message = f"non-finite at step {first.step}, phase {first.phase}"
    if first.tensor:
        message += f": {first.tensor} of {first.op or first.module or 'the run'}"
    if report.causes:
        top = report.causes[0]
        message += f"; top cause {top.id} ({top.confidence:.0%}): {top.fix}"
    return _case("finite run", message, failed=True, details=report.summary)


def _case(name: str, message: str, failed: bool, details: str | None = None) -> ET.Element:
    case = ET.Element("testcase", name=name)
    if failed:
        failure = ET.SubElement(case, "failure", message=message, type="nandoctor")
        failure.text = details or message
    else:
        ET.SubElement(case, "system-out").text = message
    return case
