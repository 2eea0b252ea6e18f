"""A tabular regressor (a GELU MLP on standardised features) trained with SGD and
momentum at a batch of 2048, its learning rate scaled up with the batch by the linear
scaling rule::

    lr = 0.1 * 2048 / 256   # = 0.8, tuned at batch 256 ... but no warmup

The rule of Goyal et al. only holds with a warmup: at 0.8 from the first step, each
update overshoots the minimum along the sharpest direction of the loss by more than it
corrects, so the error grows instead of shrinking. The loss falls for a few steps, then
climbs by an order of magnitude every step or two while the weights and the gradient
norm grow with it, until the squared error leaves float32's range (3.4e38).

The fix is a 10x smaller learning rate (0.08 trains fine), or a warmup from 0.1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def build_model(features: int = 16, hidden: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, 1),
    )


def build_data(
    batches: int = 8, batch_size: int = 2048, features: int = 16, seed: int = 12
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Standardised features; a mostly linear target with an interaction and noise."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=g) / features**0.5
    data = []
    for _ in range(batches):
        x = torch.randn(batch_size, features, generator=g)
        y = x @ w + 0.5 * torch.tanh(x[:, 0] * x[:, 1])
        data.append((x, y + 0.1 * torch.randn(batch_size, generator=g)))
    return data


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)
