"""A count regression (events per hour from a few sensor features) trained with a
hand-written Poisson negative log-likelihood::

    rate = F.relu(self.head(h))                 # "rates must be non-negative"
    loss = (rate - y * torch.log(rate)).mean()  # Poisson NLL, up to a constant

The head's bias starts at the mean count, so every rate is positive at first and the
run trains normally. Samples whose count is 0 pull their rate down without limit (the
gradient of `rate` is 1 whatever its size), and once one rate crosses 0 the ReLU makes
it an exact 0: log(0) = -inf, and for a zero count 0 * -inf = NaN. Nothing here is a
precision problem: float32, bfloat16 and float16 all fail the same way.

The fix is a link function that cannot reach 0: predict the log-rate and use
`F.poisson_nll_loss(log_rate, y, log_input=True)` (or `rate = F.softplus(...)` with
`torch.log(rate + eps)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CountRegressor(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 32, mean_count: float = 2.0) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, 1)
        with torch.no_grad():
            self.head.bias.fill_(mean_count)  # start every prediction at the mean count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.head(self.body(x))).squeeze(-1)  # BUG: relu can output exactly 0


def build_model(features: int = 8, hidden: int = 32, mean_count: float = 2.0) -> nn.Module:
    return CountRegressor(features, hidden, mean_count)


def build_data(
    batches: int = 16, batch_size: int = 64, features: int = 8, seed: int = 3
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Counts drawn from a Poisson whose log-rate is linear in the features."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=g) * 0.6
    data = []
    for _ in range(batches):
        x = torch.randn(batch_size, features, generator=g)
        rate = torch.exp(x @ w)
        y = torch.poisson(rate, generator=g)
        data.append((x, y))
    return data


def poisson_nll(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    rate = model(x)
    return (rate - y * torch.log(rate)).mean()  # log(0) once a rate is clamped to 0
