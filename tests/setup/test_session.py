"""Building a session: the user's code is called once, seeded, and checked."""

from __future__ import annotations

import pytest
import torch

from nandoctor.errors import ConfigError, UserCodeError
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session, default_loss
from tests.helpers.project import TRAIN_PY, base_config


def session_of(project, **overrides):
    return build_session(load_config(project(base_config(**overrides))))


def config_error(project, **overrides) -> str:
    """The message after the `config.yaml:LINE: ` that names the file and the key's line."""
    path = project(base_config(**overrides))
    with pytest.raises(ConfigError) as info:
        build_session(load_config(path))
    where, _, message = info.value.message.partition(": ")
    assert where.startswith(f"{path}"), info.value.message
    return message


def test_an_error_building_the_run_names_the_file_and_the_keys_line(project):
    path = project(
        "model: train.py:build_model\ndata: train.py:build_data\n"
        "optimizer: {name: SGD, lr: fast}\nsteps: 2\n"
    )
    with pytest.raises(ConfigError) as info:
        build_session(load_config(path))
    assert info.value.message == f"{path}:3: optimizer.lr: expected a number, got 'fast'"


def test_builds_everything_the_config_names(project):
    s = session_of(project, scheduler={"name": "StepLR", "step_size": 2}, clip_grad_norm=1.0)
    assert isinstance(s.model, torch.nn.Sequential)
    assert isinstance(s.optimizer, torch.optim.SGD)
    assert isinstance(s.scheduler, torch.optim.lr_scheduler.StepLR)
    assert s.scaler is None  # float32
    assert s.device == torch.device("cpu") and s.dtype == torch.float32


HALF_MODEL_PY = (
    TRAIN_PY
    + """

def build_half_model():
    return build_model().half()


def build_half_data():
    return [(x.half(), y) for x, y in build_data()]
"""
)


def test_without_autocast_the_run_computes_in_its_weights_dtype(project):
    """A builder that returns a `.half()` model computes in float16 whatever the config's
    dtype says: the report's dtype (and the headroom's range) is the weights'."""
    config = base_config(model="train.py:build_half_model", data="train.py:build_half_data")
    s = build_session(load_config(project(config, code=HALF_MODEL_PY)))
    assert s.dtype == torch.float32  # no autocast
    assert s.compute_dtype == torch.float16
    assert session_of(project).compute_dtype == torch.float32


def test_with_autocast_the_run_computes_in_autocasts_dtype(project):
    config = base_config(model="train.py:build_half_model", precision={"dtype": "bfloat16"})
    s = build_session(load_config(project(config, code=HALF_MODEL_PY)))
    assert s.compute_dtype == torch.bfloat16


def test_float16_gets_a_grad_scaler_with_the_init_scale(project):
    s = session_of(project, precision={"dtype": "fp16", "init_scale": 1024.0})
    assert s.scaler is not None and s.scaler.get_scale() == 1024.0


def test_same_seed_same_initial_weights(project):
    a, b = session_of(project, seed=3), session_of(project, seed=3)
    c = session_of(project, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))
    assert not torch.equal(next(a.model.parameters()), next(c.model.parameters()))


def test_default_loss_is_cross_entropy_of_x_y():
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    expected = torch.nn.functional.cross_entropy(model(x), y)
    assert torch.equal(default_loss(model, (x, y)), expected)


def test_default_loss_refuses_batches_that_are_not_pairs():
    with pytest.raises(ConfigError, match=r"default loss expects batches \(x, y\); got a dict"):
        default_loss(torch.nn.Linear(2, 2), {"x": 1})


def test_unknown_optimizer_suggests_the_right_name(project):
    message = config_error(project, optimizer={"name": "Adamw", "lr": 0.1})
    assert message == "optimizer.name: torch.optim has no class 'Adamw'; did you mean 'AdamW'?"


def test_wrong_optimizer_kwargs_give_the_optimizers_own_complaint(project):
    message = config_error(project, optimizer={"name": "SGD", "lr": 0.1, "betas": [0.9, 0.9]})
    assert message.startswith("optimizer: SGD(lr=0.1, betas=[0.9, 0.9]) refused:")
    assert "betas" in message


def test_invalid_optimizer_value(project):
    assert "Invalid learning rate" in config_error(project, optimizer={"name": "SGD", "lr": -1})


def test_a_boolean_is_refused_for_a_number_and_kept_for_a_flag(project):
    """YAML's `on` is True, and True is 1 to Python: a rate of 1, silently."""
    message = config_error(project, optimizer={"name": "SGD", "lr": True})
    assert message.startswith("optimizer.lr: expected a number, got true")
    optimizer = {"name": "SGD", "lr": 0.1, "momentum": 0.9, "nesterov": True}
    s = build_session(load_config(project(base_config(optimizer=optimizer))))
    assert s.optimizer.defaults["nesterov"] is True


def test_optimizer_factory(project):
    code = "import torch\n\ndef make(params, lr):\n    return torch.optim.Adam(params, lr=lr)\n"
    path = project(base_config(optimizer={"factory": "opt.py:make", "lr": 0.5}))
    (path.parent / "opt.py").write_text(code)
    s = build_session(load_config(path))
    assert isinstance(s.optimizer, torch.optim.Adam) and s.optimizer.defaults["lr"] == 0.5


def test_unknown_scheduler(project):
    message = config_error(project, scheduler={"name": "StepLr", "step_size": 1})
    assert "did you mean 'StepLR'" in message


def test_model_that_is_not_a_module(project):
    message = config_error(project, model="train.py:no_data")
    assert message == "model: train.py:no_data returned a list, expected a torch.nn.Module"


def test_model_without_parameters(project):
    path = project(base_config(model="m.py:empty"))
    (path.parent / "m.py").write_text("import torch\ndef empty():\n    return torch.nn.ReLU()\n")
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_session(load_config(path))


def test_model_builder_raising_is_the_users_error(project):
    with pytest.raises(UserCodeError) as info:
        session_of(project, model="train.py:raises")
    assert info.value.exit_code == 3
    assert info.value.user_frames()[-1].name == "raises"


def test_cuda_without_cuda_is_a_config_error(project):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "torch.cuda.is_available() is False" in config_error(project, device="cuda")
