"""The loop of the brief: a classifier trained with autocast float16 and a GradScaler,
no clipping, a learning rate on the high side, and a hand-written cross-entropy::

    loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()

It trains for several epochs, then the logits grow confident enough that softmax
underflows to exactly 0 in float16, log(0) is -inf, and -inf * 0 is NaN.
`fixed_loss` is the same objective through the fused, stable cross-entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def build_model(
    features: int = 32, hidden: int = 128, classes: int = 10, depth: int = 2
) -> nn.Module:
    """An MLP classifier: `depth` hidden layers of `hidden` units, no normalisation."""
    layers: list[nn.Module] = [nn.Linear(features, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, classes))


def build_data(
    batches: int = 16,
    batch_size: int = 64,
    features: int = 32,
    classes: int = 10,
    separation: float = 1.0,
    label_noise: float = 0.3,
    seed: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Noisy Gaussian clusters with one-hot targets, the same for a given seed."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * separation
    data = []
    for _ in range(batches):
        y = torch.randint(0, classes, (batch_size,), generator=g)
        x = centers[y] + torch.randn(batch_size, features, generator=g)
        flip = torch.rand(batch_size, generator=g) < label_noise
        y = torch.where(flip, torch.randint(0, classes, (batch_size,), generator=g), y)
        data.append((x, F.one_hot(y, classes).float()))
    return data


def handwritten_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()


def fixed_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)
