"""One builder of the run's settings and environment, for whoever drove the step:
`diagnose`'s session and the objects the hooks found in a user's loop give the same."""

from __future__ import annotations

import dataclasses

from nandoctor.diagnose.facts import environment_of, facts_of
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.record import RunResult
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.helpers.project import base_config

RESULT = RunResult("healthy", 0, 3)


def session_of(project, **overrides):
    return build_session(load_config(project(base_config(**overrides))))


def hooked_like(session) -> HookedRun:
    """What the hooks discover of the same objects in a user's loop."""
    run = HookedRun(model=session.model, device=session.device, dtype=session.dtype)
    run.note_optimizer(session.optimizer, stepping=True)
    return run


def test_a_session_and_a_hooked_run_give_the_same_facts_and_environment(project):
    session = session_of(project)
    run = hooked_like(session)
    assert facts_of(session, RESULT) == facts_of(run, RESULT)
    assert environment_of(session) == environment_of(run)
    facts = facts_of(session, RESULT)
    assert (facts.optimizer, facts.lr, facts.dtype, facts.grad_scaler) == (
        "SGD",
        0.1,
        "float32",
        False,
    )


def test_the_learning_rate_is_the_one_the_optimizer_steps_with(project):
    session = session_of(project)
    session.optimizer.param_groups[0]["lr"] = 0.025  # as a scheduler would set it
    assert facts_of(session, RESULT).lr == 0.025


def test_a_hooked_run_that_met_no_optimizer_yet_still_has_facts():
    facts = facts_of(HookedRun(), RESULT)
    assert (facts.optimizer, facts.lr, facts.dtype, facts.param_dtype) == (
        "unknown",
        None,
        "float32",
        "float32",
    )
    assert environment_of(HookedRun()).device == "cpu"


def test_the_checkpoint_is_given_by_the_driver_that_knows_it(project):
    session = session_of(project)
    facts = facts_of(session, dataclasses.replace(RESULT, start_step=10), "ckpt.pt")
    assert (facts.checkpoint, facts.start_step) == ("ckpt.pt", 10)
