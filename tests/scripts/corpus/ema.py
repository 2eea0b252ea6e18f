"""An image classifier with an exponential moving average of its weights, kept the way
timm's ModelEmaV2 keeps it: a `copy.deepcopy(model)` made once, updated in place after
each optimizer step; AdamW and a cosine schedule; a checkpoint of every state dict, and
the EMA saved whole; what the model holds printed, as a script checks it.

    python ema.py
"""

import copy
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
random.seed(0)
np.random.seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.features(x))


class ModelEma(nn.Module):
    def __init__(self, model, decay=0.9):
        super().__init__()
        self.module = copy.deepcopy(model)
        self.module.eval()
        self.decay = decay

    @torch.no_grad()
    def update(self, model):
        for ema_v, model_v in zip(
            self.module.state_dict().values(), model.state_dict().values(), strict=True
        ):
            if ema_v.is_floating_point():
                ema_v.mul_(self.decay).add_(model_v, alpha=1 - self.decay)
            else:
                ema_v.copy_(model_v)


model = Net()
ema = ModelEma(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=30)
g = torch.Generator().manual_seed(1)
data = [
    (torch.randn(16, 12, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(6)
]
for epoch in range(5):
    model.train()
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        ema.update(model)
    model.eval()
    with torch.no_grad():
        x, y = data[0]
        acc = (ema.module(x).argmax(-1) == y).float().mean().item()
    lr = scheduler.get_last_lr()[0]
    print(f"epoch {epoch} loss {loss.item():.6g} ema acc {acc:.4g} lr {lr:.6g}")
    snapshot = copy.deepcopy(model)  # a best-so-far copy, as many scripts keep one
print("modules", [name for name, _ in model.named_modules()])
print("parameters", sum(p.numel() for p in model.parameters()), len(list(snapshot.parameters())))
print("state", list(model.state_dict()), list(ema.state_dict())[:3])
print("hooks", len(model._forward_hooks), len(model._forward_pre_hooks), len(vars(model)))
torch.save(
    {
        "model": model.state_dict(),
        "ema": ema.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
    },
    "checkpoint.pt",
)
torch.save(ema.module, "ema.pt")
torch.save(optimizer, "optimizer.pt")
restored = Net()
restored.load_state_dict(torch.load("checkpoint.pt")["model"])
print("restored", torch.equal(restored.head.weight, model.head.weight))
print("rng", torch.rand(2).tolist(), random.random(), np.random.rand())
