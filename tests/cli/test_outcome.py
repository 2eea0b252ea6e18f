"""One place makes exit codes: every outcome of SPEC.md's table, through `exit_code`."""

from __future__ import annotations

import pytest
import torch

from nandoctor.cli.outcome import (
    Outcome,
    exit_code,
    of_baseline,
    of_comparison,
    of_ranks,
    of_report,
    of_watch,
)
from nandoctor.errors import ConfigError, PeerFailure, UsageError, UserCodeError
from nandoctor.report.comparison import CompareEnvironment, CompareRun, Comparison
from nandoctor.report.gate import Gate, GateCheck
from nandoctor.report.types import Environment, Report

ENV = Environment("cpu", "2.x", "float32", False, 1)


def report(status: str, gate: Gate | None = None) -> Report:
    return Report("diagnose", "c.yaml", ENV, status, 3, gate=gate)


PASSED = Gate("b.json", [GateCheck("headroom", True, "ok")])
FAILED = Gate("b.json", [GateCheck("headroom", False, "too close to 65504")])


@pytest.mark.parametrize(
    ("outcome", "code"),
    [
        (Outcome(), 0),
        (Outcome(found=True), 1),
        (Outcome(interrupted=True), 130),
        (Outcome(interrupted=True, found=True), 130),
        (Outcome(passthrough=7), 7),
        (Outcome(found=True, passthrough=7), 1),
        (Outcome(error=UsageError("bad --steps")), 2),
        (Outcome(error=ConfigError("bad key")), 2),
        (Outcome(error=UserCodeError("the model", RuntimeError("boom"))), 3),
        (Outcome(error=PeerFailure("rank 1 died")), 3),
        (Outcome(error=torch.distributed.DistError("peer hung")), 3),
        (Outcome(error=KeyboardInterrupt()), 130),
    ],
)
def test_every_outcome_has_its_exit_code(outcome, code):
    assert exit_code(outcome) == code


@pytest.mark.parametrize(
    ("status", "gate", "code"),
    [
        ("healthy", None, 0),
        ("healthy", PASSED, 0),
        ("healthy", FAILED, 1),
        ("nonfinite", None, 1),
        ("interrupted", None, 130),
        ("interrupted", FAILED, 130),  # an interrupt outranks the gate
    ],
)
def test_diagnose_exit_code_from_its_report(status, gate, code):
    assert exit_code(of_report(report(status, gate))) == code


@pytest.mark.parametrize(
    ("status", "command_code", "code"),
    [
        ("nonfinite", 0, 1),
        ("nonfinite", 1, 1),
        ("healthy", 0, 0),
        ("error", 7, 7),  # the script's own code when no NaN was found
        ("interrupted", 130, 130),
    ],
)
def test_watch_passes_the_command_code_through_unless_a_nan_was_found(status, command_code, code):
    assert exit_code(of_watch(report(status), command_code)) == code


def test_baseline_and_compare_fail_unless_healthy():
    assert exit_code(of_baseline(report("healthy"))) == 0
    assert exit_code(of_baseline(report("nonfinite"))) == 1
    env = CompareEnvironment("cpu", "2.x", 1)
    fp32 = CompareRun("float32", False, "healthy", 3, None, None, 0.5, None, 1.0)
    fp16 = CompareRun("float16", True, "nonfinite", 2, 2, "loss", 0.5, 0.1, 1.0)
    assert exit_code(of_comparison(Comparison("c.yaml", env, [fp32], ""))) == 0
    assert exit_code(of_comparison(Comparison("c.yaml", env, [fp32, fp16], ""))) == 1


def test_exit_codes_of_the_ranks_combine():
    def combined(codes):
        return exit_code(of_ranks(codes))

    assert combined({}) == 0  # every rank exited 0
    assert combined({0: 1}) == 1  # rank 0 found a NaN
    assert combined({0: 1, 1: -15}) == 1  # the others stopped once rank 0 was done
    assert combined({1: 3, 0: -15}) == 3  # a rank crashed
    assert combined({0: 2}) == 2
    assert combined({1: -9}) == 3  # killed
    assert combined({0: 1, 1: 130}) == 1  # rank 1 was stopped by SIGTERM after rank 0's verdict
