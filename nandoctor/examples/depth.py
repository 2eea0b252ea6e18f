"""Monocular depth estimation (a patch encoder, features brought back to full
resolution, a 1x1 head predicting metres per pixel) trained under float16 autocast with
a GradScaler, and a loss *summed* over every pixel of the batch::

    loss = F.mse_loss(pred, depth, reduction="sum")   # instead of the default "mean"

The loss itself is fine (autocast computes it in float32: ~6e4). Its gradient is large:
every pixel sends 2 * (pred - depth) ~ -6.5 to the head, and the head's bias gradient
adds them up over 4 x 32 x 32 = 4096 pixels: 22 000 to 34 000, finite in float16 (at
loss scale 1 every step's gradients are finite: each skip below is a true overflow of
the scale), but beyond 65504 at any loss scale above 2. The GradScaler, starting at
65536, skips the step and halves the scale, and again, and again: the weights never
change while it does, so it takes 15 skips in a row, down to a scale of 2, before one
step fits. The scale that was meant to lift small gradients out of float16's underflow
has collapsed, and nandoctor calls 10 overflow skips in a row a collapse.

The fix is `reduction="mean"` (or dividing the sum by the number of pixels before
backward), or bfloat16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DepthNet(nn.Module):
    def __init__(self, patch: int = 4, dim: int = 32) -> None:
        super().__init__()
        self.patch = patch
        self.encoder = nn.Sequential(
            nn.Linear(3 * patch * patch, dim), nn.GELU(), nn.Linear(dim, dim), nn.GELU()
        )
        self.head = nn.Linear(dim, 1)  # a 1x1 convolution, channels last

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        b, c, h, w = image.shape
        p = self.patch
        patches = image.unfold(2, p, p).unfold(3, p, p)  # b, c, h/p, w/p, p, p
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(b, h // p, w // p, c * p * p)
        features = self.encoder(patches)
        features = features.repeat_interleave(p, 1).repeat_interleave(p, 2)  # b, h, w, dim
        return self.head(features).squeeze(-1)  # metres, b, h, w


def build_model(patch: int = 4, dim: int = 32) -> nn.Module:
    return DepthNet(patch, dim)


def build_data(
    batches: int = 8, batch_size: int = 4, size: int = 32, seed: int = 10
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic indoor scenes: depth (1-10 m) is smooth; the image darkens with it."""
    g = torch.Generator().manual_seed(seed)
    ys, xs = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    data = []
    for _ in range(batches):
        tilt = torch.rand(batch_size, 2, 1, 1, generator=g)
        depth = 1.0 + 9.0 * (tilt[:, :1] * ys + tilt[:, 1:] * xs) / 2  # metres
        depth = depth.squeeze(1)
        albedo = torch.rand(batch_size, 3, 1, 1, generator=g)
        image = albedo / depth[:, None] + 0.05 * torch.randn(batch_size, 3, size, size, generator=g)
        data.append((image, depth))
    return data


def depth_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    image, depth = batch
    return F.mse_loss(model(image), depth, reduction="sum")  # BUG: summed over 4096 pixels
