"""A user's project, as the `project` fixture writes it: a small real train.py and the
config of a healthy float32 run of it, which tests change one key at a time."""

from __future__ import annotations

# A user's training module: small, real, and configurable through model_args/data_args.
TRAIN_PY = """
import torch
import torch.nn.functional as F
from torch import nn


def build_model(features=8, classes=3):
    return nn.Sequential(nn.Linear(features, 16), nn.ReLU(), nn.Linear(16, classes))


def build_data(
    batches=4, batch_size=8, features=8, classes=3, nan_at=None, inf_at=None, zero_feature=False
):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        x = torch.randn(batch_size, features, generator=g)
        if zero_feature:
            x[:, 0] = 0.0
        if nan_at is not None and i == nan_at:
            x[0, 0] = float("nan")
        if inf_at is not None and i == inf_at:
            x[1, 1] = float("inf")
        out.append((x, torch.randint(0, classes, (batch_size,), generator=g)))
    return out


def batches_generator(batches=3):
    for x, y in build_data(batches=batches):
        yield x, y


def no_data():
    return []


def not_iterable():
    return 42


def raises():
    raise RuntimeError("the user's builder broke")


NOT_CALLABLE = 3
"""


def base_config(**overrides) -> dict:
    """A small healthy float32 run of train.py."""
    config = {
        "model": "train.py:build_model",
        "data": "train.py:build_data",
        "optimizer": {"name": "SGD", "lr": 0.1},
        "precision": {"dtype": "float32"},
        "steps": 6,
        "device": "cpu",
    }
    config.update(overrides)
    return config
