"""A script whose runs differ, as an unseeded one's do: the first run's batch 3 holds a
NaN, every later run's batch 1 (it leaves a file behind to know). No nandoctor in it.

    python unseeded.py STATE_FILE
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def main(state: Path) -> None:
    nan_at = 1 if state.exists() else 3
    state.write_text("ran")
    model = nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
        if step == nan_at:
            x[0, 0] = float("nan")
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
