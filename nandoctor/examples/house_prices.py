"""A house-price regressor trained under float16 autocast on the raw sale price in
dollars. The features are standardised; the target is not::

    price = model(x)            # predicts dollars: 90 000 ... 700 000
    loss = F.l1_loss(price, y)  # mean absolute error, in dollars

In float32, or in bfloat16 (whose 8 exponent bits reach ~3.4e38), this trains: slowly,
since the net has to scale its output up to hundreds of thousands. In float16 the last
Linear's output has to become the price itself, and float16 stops at 65504: once the
predictions for the expensive houses climb past it, the head's matmul returns inf. The
loss (computed in float32 under autocast) and the weights look normal until that step.

The fix is to train on a normalised target (log-price, or price / 1e5), or in bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PriceRegressor(nn.Module):
    def __init__(self, features: int = 12, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).squeeze(-1)  # dollars: past 65504 in float16


def build_model(features: int = 12, hidden: int = 64) -> nn.Module:
    return PriceRegressor(features, hidden)


def build_data(
    batches: int = 16, batch_size: int = 128, features: int = 12, seed: int = 7
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Standardised features; the sale price in dollars, log-normal around 250 000."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=g) * 0.1
    data = []
    for _ in range(batches):
        x = torch.randn(batch_size, features, generator=g)
        log_price = 12.4 + x @ w + 0.1 * torch.randn(batch_size, generator=g)
        data.append((x, torch.exp(log_price)))  # NB: raw dollars, not normalised
    return data


def price_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.l1_loss(model(x), y)  # mean absolute error, in dollars
