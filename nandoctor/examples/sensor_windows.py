"""Activity recognition from accelerometer windows. The dataset standardises each window
by its own statistics, a common trick to remove the sensor's offset and gain::

    window = (window - window.mean(-1, keepdim=True)) / window.std(-1, keepdim=True)

Every window has some motion, except the stretch where the sensor lay still on a table
(or was unplugged and repeated its last reading): a flat axis has std 0, and every one
of its samples becomes 0 / 0 = NaN (or +-inf, where the mean is off by an ulp). The
model and the loop are fine; the batch that holds that window reaches the model
already non-finite, after some clean steps.

The fix belongs in the data: drop flat windows, or divide by `std + eps` (or
`clamp_min(eps)`), and check `torch.isfinite(x).all()` when the dataset is built.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class AccelerometerWindows(Dataset):
    """Windows of a 3-axis accelerometer, each standardised on its own."""

    def __init__(
        self,
        windows: int = 512,
        length: int = 64,
        classes: int = 4,
        still_at: int | None = 300,
        seed: int = 5,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (windows,), generator=g)
        t = torch.arange(length) / 25.0  # 25 Hz
        freq = 0.5 + self.labels.float()[:, None, None]  # each activity has its cadence
        phase = torch.rand(windows, 3, 1, generator=g) * 2 * math.pi
        motion = torch.sin(2 * math.pi * freq * t + phase)
        noise = 0.3 * torch.randn(windows, 3, length, generator=g)
        self.raw = 9.81 + motion + noise  # gravity plus motion, in m/s^2
        if still_at is not None:  # the phone lay on a table: the reading did not change
            self.raw[still_at] = self.raw[still_at, :, :1]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.raw[i]
        # per axis: remove the offset (gravity) and the gain
        window = (window - window.mean(-1, keepdim=True)) / window.std(-1, keepdim=True)  # BUG
        return window.flatten(), self.labels[i]


def build_model(length: int = 64, hidden: int = 128, classes: int = 4) -> nn.Module:
    return nn.Sequential(
        nn.Linear(3 * length, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def build_loader(
    batch_size: int = 32, windows: int = 512, still_at: int | None = 300
) -> DataLoader:
    return DataLoader(
        AccelerometerWindows(windows=windows, still_at=still_at), batch_size=batch_size
    )
