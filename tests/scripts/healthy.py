"""A small healthy training script (no nandoctor in it) that exits with the code given
as its first argument: `nandoctor watch` must pass that code through.

    python healthy.py [EXIT_CODE] [STEPS]
"""

import sys

import torch
from torch import nn


def main(steps: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    criterion = nn.CrossEntropyLoss()  # a module without parameters: part of the loss
    for _ in range(steps):
        x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    with torch.no_grad():  # evaluation: not a training step
        model(torch.randn(4, 8))
    print(f"healthy: {steps} steps, loss {loss.item():.3f}")


if __name__ == "__main__":
    code = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    main(int(sys.argv[2]) if len(sys.argv) > 2 else 5)
    sys.exit(code)
