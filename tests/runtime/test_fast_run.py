"""The fast run with a GradScaler: each skip rechecked at loss scale 1, on skips only. A
healthy float16 run keeps its handful of start-up skips as overflow events; a NaN the
scaler skips is the failure at its own step; and the recheck leaves no trace on the run."""

from __future__ import annotations

import torch

from nandoctor.runtime import recheck as recheck_module
from nandoctor.runtime.fast_run import fast_run
from nandoctor.runtime.judge import MAX_SKIP_STREAK
from nandoctor.runtime.probe import Phase, Probe
from nandoctor.runtime.recheck import ScaleOneRecheck
from nandoctor.runtime.rerun import SessionSteps
from nandoctor.runtime.snapshot import RngState, SnapshotStore
from nandoctor.runtime.step import run_step
from nandoctor.setup.load import load_config
from nandoctor.setup.session import Session, build_session

FP16_PY = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1), nn.Dropout(0.1))


def build_data(batches=12, batch_size=4):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch_size, 8, generator=g), 3 + torch.randn(batch_size, 1, generator=g))
        for _ in range(batches)
    ]


def summed_loss(model, batch):
    # summed over the batch: gradients of a few tens, so a GradScaler starting at 65536
    # overflows a handful of times before its scale fits them
    x, y = batch
    return ((model(x).float() - y) ** 2).sum()


def sqrt_loss(model, batch):
    x, y = batch
    out = model(x).float()
    distance = torch.sqrt(((out - out.detach()) ** 2).sum())  # sqrt at 0: NaN gradients
    return ((out - y) ** 2).mean() + distance
"""


def session_of(project, loss: str, **precision) -> Session:
    config = {
        "model": "train.py:build_model",
        "data": "train.py:build_data",
        "loss": f"train.py:{loss}",
        "optimizer": {"name": "Adam", "lr": 1e-3},
        "precision": {"dtype": "float16", **precision},
        "steps": 12,
        "device": "cpu",
    }
    return build_session(load_config(project(config, FP16_PY)))


def run(session: Session, *, store: bool = True):
    kept = SnapshotStore(session) if store else None
    return fast_run(session, session.config.steps, store=kept, recheck_skips=store)


def count_rechecks(monkeypatch) -> list[int]:
    asked: list[int] = []
    real = ScaleOneRecheck.__call__

    def counted(self, step):
        asked.append(step)
        return real(self, step)

    monkeypatch.setattr(recheck_module.ScaleOneRecheck, "__call__", counted)
    return asked


def test_a_healthy_fp16_run_keeps_its_handful_of_start_up_skips_as_overflows(project, monkeypatch):
    asked = count_rechecks(monkeypatch)
    result = run(session_of(project, "summed_loss"))
    skips = [e for e in result.events if e.kind == "scaler-skip"]
    assert result.status == "healthy" and result.failure is None
    assert 3 <= len(skips) < MAX_SKIP_STREAK  # a handful, at the start
    assert skips[0].step == 0 and skips[-1].step < 8
    assert {e.reason for e in skips} == {"overflow"}  # each finite at loss scale 1
    assert asked == [e.step for e in skips]  # rechecked on skips, and only there


def test_a_run_that_never_skips_never_rechecks(project, monkeypatch):
    asked = count_rechecks(monkeypatch)
    result = run(session_of(project, "summed_loss", init_scale=64.0))
    assert result.status == "healthy" and result.events == [] and asked == []


def test_the_recheck_leaves_no_trace_on_the_run(project):
    """With the rechecks (a store) or without: the same losses, norms, scales and
    weights, step for step, dropout included (the RNG is put back)."""
    rechecked = session_of(project, "summed_loss")  # NB: built and run in turn: the
    with_store = run(rechecked)  # build seeds the global RNG, the run draws from it
    plain = session_of(project, "summed_loss")
    without = run(plain, store=False)
    assert with_store.events and repr(with_store.telemetry) == repr(without.telemetry)  # NaN too
    assert [(e.step, e.scale) for e in with_store.events] == [
        (e.step, e.scale) for e in without.events
    ]
    weights = zip(rechecked.model.parameters(), plain.model.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in weights)


def test_a_recheck_restores_gradients_scaler_and_rng_as_it_found_them(project):
    session = session_of(project, "summed_loss")
    store = SnapshotStore(session)
    step, batch = next(iter(session.batches))
    store.before_step(step, batch)
    run_step(session, step, batch, Probe())  # skipped: the scaled gradients overflow
    grads = [p.grad for p in session.params]
    values = [g.clone() for g in grads]
    scale, rng = session.scaler.get_scale(), RngState.capture()
    assert ScaleOneRecheck(session, store, SessionSteps(session))(0) is False
    assert all(p.grad is g for p, g in zip(session.params, grads, strict=True))
    for g, v in zip(grads, values, strict=True):  # the skip's own, inf and NaN included
        torch.testing.assert_close(g, v, rtol=0, atol=0, equal_nan=True)
    assert session.scaler.get_scale() == scale
    assert torch.equal(torch.get_rng_state(), rng.torch)


def test_a_nan_the_scaler_skips_is_the_failure_at_its_own_step(project):
    result = run(session_of(project, "sqrt_loss"))
    failure = result.failure
    assert result.status == "nonfinite" and failure is not None
    assert (failure.step, failure.phase, failure.hidden) == (0, Phase.BACKWARD, True)
    assert failure.replay_scale == 1.0 and result.events == []


def test_a_run_given_no_store_keeps_its_own_and_rechecks_every_skip(project):
    """A what-if replay keeps no snapshots for a localisation, but its skips are rechecked
    all the same: a fix whose replay got past a NaN only because the scaler skipped it
    is no fix (a plain run of the fixed config fails there)."""
    session = session_of(project, "sqrt_loss")
    result = fast_run(session, session.config.steps)
    assert (result.failure.step, result.failure.hidden, result.events) == (0, True, [])


def test_without_rechecks_a_skip_is_unchecked_and_only_a_collapse_fails(project):
    result = run(session_of(project, "sqrt_loss"), store=False)
    skips = [e for e in result.events if e.kind == "scaler-skip"]
    assert {e.reason for e in skips} == {"unchecked"}
    assert len(skips) == MAX_SKIP_STREAK  # the 10th skip, the collapse itself, included
    assert result.failure is not None and result.failure.collapsed
    assert (result.failure.step, result.failure.phase) == (0, Phase.BACKWARD)
