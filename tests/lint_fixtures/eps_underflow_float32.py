"""No float16 anywhere (float32, or bfloat16 autocast): tiny epsilons are representable."""

import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-12))
opt = torch.optim.Adam(model.parameters(), eps=1e-10)


def normalize(x):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return x / (x.std() + 1e-8)
