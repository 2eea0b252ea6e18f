"""Forecasting a window total (say, the energy a building uses over the next 64 hours
from the hourly readings so far) with a learnable linear recurrence, an exponential
moving average whose per-channel decay is a plain parameter::

    h = self.decay * h + u[:, t]          # decay initialised at 0.5, unconstrained

trained with SGD and momentum and no gradient clipping. The target is a total, so the
best decay is exactly 1: the edge of stability. As training pushes the decay up, the
gradient of every step reaches further back (its size grows like 1 / (1 - decay)^2),
and near 1 the gradient norm starts to climb, by orders of magnitude within a few steps:
one large step carries the decay past 1, where h grows like decay^64 and the gradient
like 64 * decay^63, the next update throws the decay far above 1, and the recurrence
overflows float32. The loss shows nothing until the last two steps.

The fix is `clip_grad_norm: 1.0` (every RNN recipe clips), or a parametrisation that
cannot leave (0, 1), such as `decay = torch.sigmoid(self.logit)` as in the LRU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EMARecurrence(nn.Module):
    def __init__(self, dim: int, init: float = 0.5) -> None:
        super().__init__()
        self.decay = nn.Parameter(torch.full((dim,), init))  # BUG: nothing keeps it below 1

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        h = torch.zeros_like(u[:, 0])
        for t in range(u.shape[1]):
            h = self.decay * h + u[:, t]
        return h


class TotalForecaster(nn.Module):
    def __init__(self, features: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.encode = nn.Linear(features, dim)
        self.ema = EMARecurrence(dim)
        self.readout = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(self.ema(self.encode(x))).squeeze(-1)


def build_model(features: int = 4, dim: int = 16) -> nn.Module:
    return TotalForecaster(features, dim)


def build_data(
    batches: int = 16, batch_size: int = 32, length: int = 64, features: int = 4, seed: int = 13
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Standardised hourly readings; the target is the window's (scaled) total."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=g)
    data = []
    for _ in range(batches):
        x = torch.randn(batch_size, length, features, generator=g)
        data.append((x, (x @ w).sum(1) / length**0.5))
    return data


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)
