"""A float32 loop with a backbone and a separate head, `head(backbone(x))`, whose
backbone overflows at step BLOW_AT: its batch is finite throughout (no nandoctor in it).

python two_roots.py [BLOW_AT] [STEPS]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.gain = 1.0  # the loop raises it at BLOW_AT: float32 overflows to inf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.gain


def main(blow_at: int, steps: int) -> None:
    torch.manual_seed(0)
    backbone, head = Backbone(), nn.Linear(16, 3)
    params = [*backbone.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
        backbone.gain = 1e39 if step == blow_at else 1.0
        optimizer.zero_grad()
        F.cross_entropy(head(backbone(x)), y).backward()
        optimizer.step()
    print("trained", steps, "steps")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3, int(sys.argv[2]) if len(sys.argv) > 2 else 8)
