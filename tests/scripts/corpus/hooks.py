"""A classifier with hooks of its own, as scripts add them: a forward pre-hook that clamps
the input, a forward hook that keeps a layer's features (for a feature loss, or to log
them); its repeated block compiled alone (`torch.compile(block)`, the regional recipe);
the model saved whole after every epoch and loaded back, an EMA copy made by
`copy.deepcopy(model)`; every module's hooks printed, as a script checks them.

    python hooks.py --backend aot_eager
"""

import argparse
import copy
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="inductor")
args = parser.parse_args()
torch.manual_seed(0)
random.seed(0)
np.random.seed(0)
FEATURES = {}


def clamp_input(module, inputs):
    return (inputs[0].clamp(-3, 3),)


def keep_features(module, inputs, output):
    FEATURES["stem"] = output.detach()


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(10, 16)
        self.block = torch.compile(Block(16), backend=args.backend)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.block(torch.relu(self.stem(x))))


def hooks(module):
    """Each module's hooks, by name: what the script put there."""
    return {
        name: (
            [h.__name__ for h in m._forward_pre_hooks.values()],
            [h.__name__ for h in m._forward_hooks.values()],
        )
        for name, m in module.named_modules()
        if m._forward_pre_hooks or m._forward_hooks
    }


model = Net()
model.stem.register_forward_pre_hook(clamp_input)
model.stem.register_forward_hook(keep_features)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
g = torch.Generator().manual_seed(2)
data = [
    (torch.randn(16, 10, generator=g) * 2, torch.randint(0, 3, (16,), generator=g))
    for _ in range(4)
]
for epoch in range(3):
    for x, y in data:
        loss = F.cross_entropy(model(x), y) + 1e-3 * FEATURES["stem"].pow(2).mean()
        print("in the step", hooks(model))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(model, "model.pt")
    ema = copy.deepcopy(model)
    loaded = torch.load("model.pt", weights_only=False)
    with torch.no_grad():
        same = torch.equal(loaded(data[0][0]), model(data[0][0]))
    print(f"epoch {epoch} loss {loss.item():.6g} loaded the same {same}")
    print("saved", hooks(loaded), "copied", hooks(ema))
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
