"""A float16 loop whose backward makes a NaN at every EVERY-th step from FIRST on, while
its loss stays finite: the loss adds 0 x sqrt(0), whose derivative is inf (0 x inf is NaN
at any loss scale). The GradScaler skips each of those steps and halves its scale; the
steps between are clean, so the skips are scattered and the scale only collapses to 1
many steps later. No nandoctor in it.

python hidden_skips.py [FIRST] [EVERY] [STEPS]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn


def main(first: int, every: int, steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y)
            if step >= first and (step - first) % every == 0:
                loss = loss + 0.0 * torch.sqrt((logits - logits.detach()).float().pow(2).sum())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    print("done")


if __name__ == "__main__":
    first, every, steps = [int(a) for a in [*sys.argv[1:4], *("4", "3", "80")[len(sys.argv) - 1 :]]]
    main(first, every, steps)
