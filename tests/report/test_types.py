"""The report is plain data: JSON in SPEC order, non-finite floats as strings, round trip."""

from __future__ import annotations

import json

from nandoctor.report.types import Cause, Environment, Event, FirstNonfinite, Report, Telemetry


def sample() -> Report:
    telemetry = Telemetry()
    telemetry.append(0, 2.5, 0.5, 65536.0)
    telemetry.append(1, float("nan"), float("inf"), 65536.0)
    return Report(
        command="diagnose",
        config="configs/x.yaml",
        environment=Environment("cpu", "2.13.0", "float16", True, 2),
        status="nonfinite",
        steps_completed=1,
        first_nonfinite=FirstNonfinite(step=1, phase="loss"),
        causes=[Cause("log-of-softmax", "t", 0.9, ["e"], "f")],
        events=[Event(0, "scaler-skip", 65536.0)],
        telemetry=telemetry,
    )


def test_json_is_strict_and_keeps_nonfinite_values_as_strings():
    text = sample().to_json()
    data = json.loads(text)  # strict JSON: no NaN literal
    assert data["telemetry"]["loss"] == [2.5, "nan"]
    assert data["telemetry"]["grad_norm"] == [0.5, "inf"]
    assert list(data)[:4] == ["schema_version", "tool", "command", "name"]


def test_round_trip():
    report = sample()
    again = Report.from_dict(json.loads(report.to_json()))
    assert again.to_dict() == report.to_dict()


def test_a_report_written_when_reproduced_was_a_boolean_reads_as_a_word():
    data = json.loads(sample().to_json())
    for old, word in ((True, "exact"), (False, "not-reproduced"), (None, None)):
        data["first_nonfinite"]["reproduced"] = old
        assert Report.from_dict(data).first_nonfinite.reproduced == word
    assert data["first_nonfinite"]["reproduced"] is None  # the caller's data is left as it was
