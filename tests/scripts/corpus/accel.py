"""A classifier trained through Hugging Face Accelerate: `accelerator.prepare` for the
model, optimizer, data and scheduler, `accelerator.backward(loss)`, its clipping, and
`accelerator.save` of the unwrapped model's state.

    python accel.py --nan-at 6    (a NaN in batch 6)
"""

import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", type=int, default=None)
args = parser.parse_args()
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)

accelerator = Accelerator(cpu=True)
g = torch.Generator().manual_seed(4)
features, labels = torch.randn(80, 6, generator=g), torch.randint(0, 2, (80,), generator=g)
if args.nan_at is not None:
    features[args.nan_at * 8 + 2, 1] = float("nan")
loader = DataLoader(TensorDataset(features, labels), batch_size=8)
model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=5)
model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
step = 0
for _epoch in range(2):
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        accelerator.print(f"step {step} loss {loss.item():.6g}")
        step += 1
accelerator.wait_for_everyone()
accelerator.save(accelerator.unwrap_model(model).state_dict(), "accel.pt")
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
