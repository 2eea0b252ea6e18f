"""Metric learning with a triplet loss and a hand-written Euclidean distance::

    d_ap = torch.sqrt(((anchor - positive) ** 2).sum(-1))
    loss = F.relu(d_ap - d_an + margin).mean()

The triplet sampler draws the positive from the anchor's class without excluding the
anchor itself, so now and then the positive *is* the anchor: the same input, through
the same network, at the same row of its batch, gives the same embedding bit for bit.
The distance is then sqrt(0) = 0, a perfectly finite forward and loss; but the
derivative of sqrt at 0 is infinite: its backward divides the incoming gradient by
2 * sqrt(0) = 0 (inf, or NaN where that gradient is 0, as for a triplet already past the
margin), and the chain rule multiplies it by (anchor - positive) = 0: NaN. Every
gradient of the step is NaN while the loss looks normal.

The fix is `F.pairwise_distance` / `F.triplet_margin_loss` (they add an eps inside), or
`torch.sqrt(sq + 1e-12)`, and a sampler that never pairs a sample with itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def build_model(features: int = 32, hidden: int = 64, dim: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, dim))


def build_data(
    batches: int = 16,
    batch_size: int = 32,
    classes: int = 8,
    per_class: int = 200,
    features: int = 32,
    seed: int = 7,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(anchor, positive, negative) triplets of product feature vectors."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g)
    items = centers.repeat_interleave(per_class, 0)
    items = items + torch.randn(items.shape, generator=g)
    labels = torch.arange(classes).repeat_interleave(per_class)
    data = []
    for _ in range(batches):
        a = torch.randint(0, len(items), (batch_size,), generator=g)
        # BUG: the positive is any item of the anchor's class, the anchor itself included
        p = labels[a] * per_class + torch.randint(0, per_class, (batch_size,), generator=g)
        other = (labels[a] + torch.randint(1, classes, (batch_size,), generator=g)) % classes
        n = other * per_class + torch.randint(0, per_class, (batch_size,), generator=g)
        data.append((items[a], items[p], items[n]))
    return data


def triplet_loss(model: nn.Module, batch, margin: float = 1.0) -> torch.Tensor:
    anchor, positive, negative = (model(x) for x in batch)
    d_ap = torch.sqrt(((anchor - positive) ** 2).sum(-1))  # sqrt(0) when positive is anchor
    d_an = torch.sqrt(((anchor - negative) ** 2).sum(-1))
    return F.relu(d_ap - d_an + margin).mean()
