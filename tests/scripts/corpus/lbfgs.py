"""A small regression fitted with L-BFGS, its loss in a closure.

python lbfgs.py --nan-at 4    (a NaN target from step 4 on)
"""

import argparse
import random

import numpy as np
import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--nan-at", type=int, default=None)
args = parser.parse_args()
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)

model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 1))
optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
x = torch.randn(64, 3)
y = x.sum(1, keepdim=True).sin()
for step in range(8):
    if step == args.nan_at:
        y[7, 0] = float("nan")

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = optimizer.step(closure)
    print(f"step {step} loss {loss.item():.6g}")
torch.save(model, "lbfgs.pt")
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
