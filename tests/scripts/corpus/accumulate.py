"""A classifier trained with gradient accumulation, the way most training scripts write
it: the loss divided by the accumulation steps, an optimizer step every 4 micro-batches,
the gradient norm clipped before it; the logged loss is the step's sum.

    python accumulate.py --nan-at 13    (a NaN in micro-batch 13: step 3, micro-batch 1)
"""

import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", type=int, default=None, help="a NaN in this micro-batch")
args = parser.parse_args()
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
ACCUMULATE = 4

model = nn.Sequential(nn.Linear(10, 32), nn.GELU(), nn.Linear(32, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(2)
step, logged = 0, 0.0
for i in range(32):
    x, y = torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g)
    if i == args.nan_at:
        x[1, 4] = float("nan")
    loss = F.cross_entropy(model(x), y) / ACCUMULATE
    loss.backward()
    logged += loss.item()
    if (i + 1) % ACCUMULATE == 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {logged:.6g}")
        step, logged = step + 1, 0.0
torch.save(model.state_dict(), "model.pt")
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
