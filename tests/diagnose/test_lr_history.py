"""learning-rate-too-high quotes the rate *in effect* at the failing step: a scheduler that
multiplied the config's lr 25000x at step 40 made the rate that diverged, and the evidence,
the fix and the what-if say so, with that rate, not the config's."""

from __future__ import annotations

from types import SimpleNamespace

from nandoctor.diagnose.engine import diagnose
from nandoctor.diagnose.lr_history import LrHistory
from nandoctor.setup.load import load_config
from tests.helpers.project import base_config

# A regression trained with SGD at a tiny rate, until a schedule whose warmup factor was
# applied as a multiplier from step 40 on: 4e-6 x 25000 = 0.1, and the loss diverges.
JUMP_PY = """
import torch
import torch.nn.functional as F
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def build_data(batches=8, batch_size=32):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=g)
    out = []
    for _ in range(batches):
        x = 2 * torch.randn(batch_size, 8, generator=g)
        out.append((x, x @ w))
    return out


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def jump(optimizer, at=40, factor=25000.0):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < at else factor)
"""


def jump_config(**overrides) -> dict:
    return base_config(
        loss="train.py:mse",
        optimizer={"name": "SGD", "lr": 4.0e-6},
        scheduler={"factory": "train.py:jump", "at": 40, "factor": 25000.0},
        steps=200,
        **overrides,
    )


def test_the_rate_in_effect_and_the_schedulers_jump_are_the_evidence(project):
    report = diagnose(load_config(project(jump_config(), JUMP_PY)))
    assert report.status == "nonfinite" and report.first_nonfinite.step > 40
    top = report.causes[0]
    assert top.id == "learning-rate-too-high", [(c.id, c.confidence) for c in report.causes]
    step = report.first_nonfinite.step
    jump = "the scheduler (LambdaLR) multiplied the learning rate 2.5e+04x at step 40, "
    assert any(e.startswith(jump + "from 4e-06 to 0.1") for e in top.evidence), top.evidence
    assert f"the optimizer is SGD, at lr=0.1 in effect at step {step}" in top.evidence
    assert not any("lr=4e-06" in e for e in top.evidence)
    # NB: the change is to the rate the config sets, which the scheduler scales: setting
    # lr=0.01 as told would put 250 in effect after the jump
    assert (
        f"from the 0.1 in effect at step {step} to 0.01 (`lr=4e-06` -> `lr=4e-07`, "
        "the rate you set and the scheduler scales)" in top.fix
    )
    assert "its 2.5e+04x jump at step 40" in top.fix
    # the what-if: the config's lr / 10, so 0.01 after the jump; that holds
    assert top.verified is True, top.verification
    assert top.verification.startswith(
        f"with a 10x smaller learning rate (0.01 in effect at step {step}, instead of 0.1)"
    )


def test_the_history_keeps_the_rate_each_step_started_with():
    history = LrHistory()
    group = {"lr": 1e-3}
    ctx = SimpleNamespace(session=SimpleNamespace(optimizer=SimpleNamespace(param_groups=[group])))
    for step, lr in enumerate([1e-3, 1e-3, 2e-3, 2e-3, 5e-2, 5e-2]):
        group["lr"] = lr
        ctx.step = step
        history.step_started(ctx)
    assert history.changes == [(0, 1e-3), (2, 2e-3), (4, 5e-2)]
    assert (history.at(3), history.at(5), history.start()) == (2e-3, 5e-2, 1e-3)
    jump = history.largest_jump(until=5)
    assert (jump.step, jump.before, jump.after) == (4, 2e-3, 5e-2)
    assert history.largest_jump(until=3).step == 2
