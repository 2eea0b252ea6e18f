"""A model cast to float16 with .half(): its epsilons and Adam's state live in float16."""

import torch
import torch.nn as nn

EPS = 1e-10


class Net(nn.Module):
    def __init__(self, d=512, eps=1e-12):
        super().__init__()
        self.norm = nn.LayerNorm(d, eps=1e-12)  # expect: eps-underflow
        self.bn = nn.BatchNorm1d(d, 1e-9)  # expect: eps-underflow
        self.ok = nn.LayerNorm(d, eps=1e-5)
        self.eps = eps

    def forward(self, x):
        var = x.var(-1, keepdim=True)
        x = x / torch.sqrt(var + self.eps)  # expect: eps-underflow
        return x / (x.abs().amax(-1, keepdim=True) + EPS)  # expect: eps-underflow


model = Net().cuda().half()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # expect: eps-underflow
opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)  # expect: eps-underflow
opt3 = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
sgd = torch.optim.SGD(model.parameters(), lr=0.1)
