"""Runs built to test what a what-if replay may call verified (diagnose/test_verify_replays.py).

- A bag-of-words document classifier in float16 with a GradScaler: each document's vector
  is the sum of its words' embeddings (padding masked out) and its length,
  `sqrt(sum(v ** 2))`, is a feature. An empty document (all padding, at EMPTY_AT) has the
  zero vector: sqrt(0) = 0 is a finite forward, but its backward divides by 0 and the
  chain rule multiplies that inf by the vector's 0: NaN in the embedding's gradient, at
  any loss scale. The GradScaler skips the step as if it had overflowed; the loss, which
  has fallen close to 0 by then, never shows it.
- A Gaussian regression trained on its negative log-likelihood, whose loss is negative
  once the predicted variance is small (a density's NLL has no floor at 0).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
CLASSES = 4
EMPTY_AT = 61  # the batch that holds an empty document


class BagOfWords(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim + 1, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids != 0).unsqueeze(-1).float()  # 0 is padding
        vec = (self.embed(ids) * mask).sum(1)
        length = torch.sqrt((vec**2).sum(-1, keepdim=True))  # marker:doc-length
        return self.head(torch.cat([vec, length], -1))


def build_classifier(dim: int = 16) -> nn.Module:
    return BagOfWords(dim)


def build_documents(
    batches: int = 80, batch_size: int = 16, words: int = 6, empty_at: int = EMPTY_AT
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Documents on one of CLASSES topics, each topic with its own words (padding, 0, at
    the end of the shorter ones); at `empty_at` one document is empty."""
    g = torch.Generator().manual_seed(0)
    per_topic = (VOCAB - 1) // CLASSES
    out = []
    for i in range(batches):
        labels = torch.randint(0, CLASSES, (batch_size,), generator=g)
        words_of = torch.randint(0, per_topic, (batch_size, words), generator=g)
        ids = 1 + labels[:, None] * per_topic + words_of
        ids[:, words // 2 :] *= torch.rand(batch_size, 1, generator=g) < 0.5  # shorter ones
        if i == empty_at:
            ids[3] = 0
        out.append((ids, labels))
    return out


class Gaussian(nn.Module):
    """Predicts a mean and a log-variance for each input."""

    def __init__(self, features: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Linear(hidden, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def build_gaussian(features: int = 4, hidden: int = 32) -> nn.Module:
    return Gaussian(features, hidden)


def build_regression(
    batches: int = 40, batch_size: int = 32, features: int = 4, noise: float = 0.05
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(features, generator=g)
    out = []
    for _ in range(batches):
        x = torch.randn(batch_size, features, generator=g)
        out.append((x, x @ w + noise * torch.randn(batch_size, generator=g)))
    return out


def gaussian_nll(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    mean, log_var = model(x).float().unbind(-1)
    return 0.5 * (log_var + (y - mean) ** 2 / log_var.exp() + math.log(2 * math.pi)).mean()


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, labels = batch
    return F.cross_entropy(model(ids).float(), labels)


def restarted_schedule(optimizer: torch.optim.Optimizer, at: int = 50, factor: float = 100.0):
    """A schedule whose restart multiplies the rate `factor` times at step `at` (a warm
    restart meant to return to the base rate, applied to an already-peaked one)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 if step < at else factor)
