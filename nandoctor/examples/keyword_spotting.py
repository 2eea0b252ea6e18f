"""Keyword spotting on one-second clips of log-mel frames, with a hand-written RMSNorm
after a bias-free input projection, trained under float16 autocast::

    x = self.proj(frames)                                        # Linear(bias=False)
    x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-8)   # RMSNorm, eps 1e-8

Most clips are a full second; the few shorter ones are padded with zero frames, as
Speech Commands loaders do. A zero frame projects to an exact zero row, and the
normalisation is meant to give 0 / sqrt(0 + eps) = 0 there. But under autocast the
projection's output is float16 and so is everything computed from it (autocast, CUDA's
and the CPU's alike, leaves the multiply, mean, add and sqrt in float16): 1e-8 is below
float16's smallest subnormal (6e-8) and rounds to exactly 0, so the row becomes
0 / sqrt(0) = 0 / 0 = NaN. The first short clip arrives after some clean steps. float32
and bfloat16 (whose exponent range holds 1e-8) survive the same run. (Written
`x.pow(2)`, the line survives on a GPU: CUDA autocast runs `pow` in float32.)

The fix is an epsilon the dtype can hold (1e-5, `torch.finfo(torch.float16).tiny`), or
computing the norm in float32 (`x.float()`, then cast back), as LLaMA's RMSNorm does.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-8) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BUG: computed in x's dtype; eps = 1e-8 is 0 in float16
        return self.weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps))


class FrameMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class KeywordSpotter(nn.Module):
    def __init__(self, mels: int = 20, dim: int = 32, layers: int = 2, keywords: int = 10):
        super().__init__()
        self.proj = nn.Linear(mels, dim, bias=False)  # the norm that follows makes a bias moot
        self.norm = RMSNorm(dim)
        self.blocks = nn.Sequential(*(FrameMLP(dim) for _ in range(layers)))
        self.head = nn.Linear(dim, keywords)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.norm(self.proj(frames)))
        return self.head(x.mean(1))  # average over time


def build_model(mels: int = 20, dim: int = 32, layers: int = 2) -> nn.Module:
    return KeywordSpotter(mels, dim, layers)


def build_data(
    batches: int = 16,
    batch_size: int = 16,
    frames: int = 20,
    mels: int = 20,
    keywords: int = 10,
    first_short_clip: int | None = 6,
    seed: int = 9,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Normalised log-mel frames; from batch `first_short_clip` on, one clip per batch
    is shorter than a second and padded with zero frames."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(keywords, frames, mels, generator=g)
    data = []
    for i in range(batches):
        y = torch.randint(0, keywords, (batch_size,), generator=g)
        x = 0.5 * patterns[y] + torch.randn(batch_size, frames, mels, generator=g)
        if first_short_clip is not None and i >= first_short_clip:
            length = int(torch.randint(frames // 2, frames, (), generator=g))
            x[0, length:] = 0.0  # zero padding up to one second
        data.append((x, y))
    return data
