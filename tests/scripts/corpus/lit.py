"""A LightningModule fitted by `Trainer.fit`, on the CPU, without logger, progress bar or
checkpoints; its loss printed as it trains.

    python lit.py --nan-at 5    (a NaN in batch 5)
"""

import argparse
import random

import lightning as L
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", type=int, default=None)
args = parser.parse_args()
L.seed_everything(0, verbose=False)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        print(f"step {self.global_step} loss {loss.item():.6g}")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


g = torch.Generator().manual_seed(5)
features, labels = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
if args.nan_at is not None:
    features[args.nan_at * 8 + 1, 4] = float("nan")
loader = DataLoader(TensorDataset(features, labels), batch_size=8)
model = Classifier()
trainer = L.Trainer(
    max_epochs=1,
    accelerator="cpu",
    logger=False,
    enable_progress_bar=False,
    enable_checkpointing=False,
    enable_model_summary=False,
)
trainer.fit(model, loader)
torch.save(model.net.state_dict(), "lit.pt")
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
