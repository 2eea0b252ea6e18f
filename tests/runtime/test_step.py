"""The one training step: phases in order, the loss scale removed before clipping, and
nothing left behind on the model."""

from __future__ import annotations

import itertools

import pytest
import torch

from nandoctor.errors import ConfigError, UserCodeError
from nandoctor.runtime.probe import Phase, Probe
from nandoctor.runtime.step import run_step
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.helpers.project import base_config


class Recorder(Probe):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.grad_norm_after_backward: float | None = None

    def step_started(self, ctx):
        self.events.append(("start", str(ctx.step)))

    def phase_started(self, ctx, phase):
        self.events.append(("enter", phase.value))

    def phase_ended(self, ctx, phase):
        self.events.append(("exit", phase.value))
        if phase is Phase.BACKWARD:
            grads = [p.grad.float().norm() for p in ctx.session.params]
            self.grad_norm_after_backward = torch.stack(grads).norm().item()

    def step_ended(self, ctx):
        self.events.append(("end", str(ctx.step)))


def one_step(project, probe=None, **overrides):
    session = build_session(load_config(project(base_config(**overrides))))
    step, batch = next(iter(session.batches))
    probe = probe or Recorder()
    run_step(session, step, batch, probe)
    return session, probe


def test_phases_in_order_with_forward_nested_in_loss(project):
    _, probe = one_step(project)
    assert probe.events == [
        ("start", "0"),
        ("enter", "input"), ("exit", "input"),
        ("enter", "loss"),
        ("enter", "forward"), ("exit", "forward"),
        ("exit", "loss"),
        ("enter", "backward"), ("exit", "backward"),
        ("enter", "optimizer"), ("exit", "optimizer"),
        ("end", "0"),
    ]  # fmt: skip


def test_gradients_are_unscaled_before_clipping(project):
    """With a scale of 2**16 and clipping to 1.0, clipping scaled gradients would leave the
    true gradients ~65536x too small; the step must unscale first."""
    _, clipped = one_step(project, precision={"dtype": "fp16"}, clip_grad_norm=1e9)
    _, reference = one_step(project, precision={"dtype": "fp16"})
    assert clipped.grad_norm_after_backward == pytest.approx(reference.grad_norm_after_backward)
    assert 1e-3 < reference.grad_norm_after_backward < 1e2  # unscaled magnitude, not 2**16 x


def test_clipping_bounds_the_true_gradient_norm(project):
    _, probe = one_step(project, precision={"dtype": "fp16"}, clip_grad_norm=0.01)
    assert probe.grad_norm_after_backward == pytest.approx(0.01, rel=1e-2)


def test_the_step_updates_the_weights(project):
    session = build_session(load_config(project(base_config())))
    before = [p.detach().clone() for p in session.params]
    for step, batch in itertools.islice(session.batches, 2):
        run_step(session, step, batch, Probe())
    assert any(not torch.equal(a, b) for a, b in zip(before, session.params, strict=True))


def test_no_hook_is_left_on_the_model(project):
    session, _ = one_step(project)
    assert not session.model._forward_hooks and not session.model._forward_pre_hooks


def test_loss_that_is_not_a_scalar(project, tmp_path):
    (tmp_path / "losses.py").write_text(
        "import torch.nn.functional as F\n"
        "def per_sample(model, batch):\n"
        "    x, y = batch\n"
        "    return F.cross_entropy(model(x), y, reduction='none')\n"
        "def a_float(model, batch):\n"
        "    return 1.0\n"
    )
    with pytest.raises(
        ConfigError, match=r"loss: returned a tensor of shape \[8\], expected a scalar"
    ):
        one_step(project, loss="losses.py:per_sample")
    with pytest.raises(
        ConfigError, match=r"loss: returned a float, expected a scalar torch\.Tensor"
    ):
        one_step(project, loss="losses.py:a_float")


def test_loss_raising_is_the_users_error_and_phases_are_unwound(project, tmp_path):
    (tmp_path / "losses.py").write_text(
        "def broken(model, batch):\n    return model(batch[0][:, :3])\n"
    )
    with pytest.raises(UserCodeError) as info:
        one_step(project, loss="losses.py:broken")
    assert info.value.where == "loss (step 0)"
    assert any(f.filename.endswith("losses.py") for f in info.value.user_frames())
