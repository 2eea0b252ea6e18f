"""Speaker identification with an x-vector style network: frame-level layers, then
statistics pooling (the mean and standard deviation of every channel over time), then
utterance-level layers. The standard deviation is written the textbook way::

    var = (h ** 2).mean(1) - h.mean(1) ** 2      # E[h^2] - E[h]^2
    std = torch.sqrt(var)

Mathematically `var` is never negative. Numerically it is the difference of two
rounded numbers, and when a channel does not vary over the utterance its true value is
0: the two terms are equal up to their last bits, and the difference comes out 0 or a
few ulps either side. The first utterance of digital silence (all-zero samples, whose
log-mel frames are all the same floor, log(1e-10)) makes every channel constant over
time; about a third of them get a negative `var`, and sqrt of a negative is NaN. This
run is float32: no reduced precision needed. (In bfloat16 the cancellation bites far
sooner, on ordinary speech.)

The fix is `h.std(1)` / `torch.var(h, 1)` (which subtract the mean first), or
`torch.sqrt(var.clamp_min(1e-5))`, as the x-vector recipes do; and dropping silent
utterances with a voice-activity detector.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class StatsPooling(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mean = h.mean(1)
        var = (h**2).mean(1) - mean**2  # BUG: cancels, and can round below 0
        return torch.cat([mean, torch.sqrt(var)], dim=-1)


class XVector(nn.Module):
    def __init__(self, mels: int = 24, channels: int = 64, embed: int = 32, speakers: int = 20):
        super().__init__()
        self.frames = nn.Sequential(
            nn.Linear(mels, channels), nn.GELU(), nn.Linear(channels, channels), nn.GELU()
        )
        self.pool = StatsPooling()
        self.embedding = nn.Linear(2 * channels, embed)
        self.classifier = nn.Sequential(nn.GELU(), nn.Linear(embed, speakers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embedding(self.pool(self.frames(x))))


def build_model(mels: int = 24, channels: int = 64, speakers: int = 20) -> nn.Module:
    return XVector(mels, channels, speakers=speakers)


def build_data(
    batches: int = 16,
    batch_size: int = 16,
    frames: int = 50,
    mels: int = 24,
    speakers: int = 20,
    silence_at: int | None = 9,
    seed: int = 11,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Log-mel utterances: a speaker's timbre plus phonetic variation over time.

    Batch `silence_at` holds one utterance of digital silence: log(1e-10) everywhere."""
    g = torch.Generator().manual_seed(seed)
    timbre = torch.randn(speakers, mels, generator=g)
    phones = torch.randn(32, mels, generator=g)
    data = []
    for i in range(batches):
        y = torch.randint(0, speakers, (batch_size,), generator=g)
        sequence = torch.randint(0, len(phones), (batch_size, frames), generator=g)
        x = (
            timbre[y, None]
            + phones[sequence]
            + 0.3 * torch.randn(batch_size, frames, mels, generator=g)
        )
        if i == silence_at:
            x[3] = math.log(1e-10)  # log-mel of all-zero samples: the floor, everywhere
        data.append((x, y))
    return data
