"""A model trained compiled, as the PyTorch 2 tutorials compile it: the module form,
`torch.compile(model)`, for the training forward, and the function form, a compiled
evaluation step; a plain SGD loop around them.

    python compiled.py --nan-at 5    (a NaN in step 5's batch)
"""

import argparse
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", type=int, default=None)
parser.add_argument("--backend", default="inductor")
args = parser.parse_args()
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
compiled = torch.compile(model, backend=args.backend)


@torch.compile(backend=args.backend)
def evaluate(x, y):
    return F.cross_entropy(model(x), y)


g = torch.Generator().manual_seed(3)
x_val, y_val = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
for step in range(8):
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    if step == args.nan_at:
        x[2, 3] = float("nan")
    optimizer.zero_grad()
    loss = F.cross_entropy(compiled(x), y)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        val = evaluate(x_val, y_val)
    print(f"step {step} loss {loss.item():.6g} val {val.item():.6g}")
torch.save(model.state_dict(), "compiled.pt")
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
