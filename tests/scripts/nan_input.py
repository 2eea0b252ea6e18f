"""A plain float32 loop whose batch at step NAN_AT holds a NaN (no nandoctor in it).

python nan_input.py [NAN_AT] [STEPS]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn


def main(nan_at: int, steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
        if step == nan_at:
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    print("trained", steps, "steps")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, int(sys.argv[2]) if len(sys.argv) > 2 else 8)
