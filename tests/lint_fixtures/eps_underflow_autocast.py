"""Autocast float16 only: layers and the optimizer stay float32, hand-written math does not."""

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d, eps=1e-12)  # float32 under autocast

    def forward(self, x):
        a = x / (x.norm(dim=-1, keepdim=True) + 1e-8)  # expect: eps-underflow
        b = x * torch.rsqrt(x.pow(2).mean(-1) + 1e-8)  # expect: eps-underflow
        s = x.std(-1, keepdim=True)
        c = (x - x.mean(-1, keepdim=True)) / (s + 1e-8)  # expect: eps-underflow
        d = x / (x.float().abs().amax() + 1e-10)  # computed in float32 on purpose
        e = x * torch.rsqrt(x.float().pow(2).mean(-1) + 1e-6)  # 1e-6 fits float16 anyway
        return self.norm(a + b + c + d + e)


def metrics(x):
    return x / (x.sum() + 1e-8)  # not differentiated: a metric


model = Block(64).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-10)  # float32 state: fine
scaler = torch.cuda.amp.GradScaler()
with torch.autocast("cuda", dtype=torch.float16):
    loss = model(torch.randn(8, 64, device="cuda")).mean()
    loss = loss + padded_softmax(torch.randn(8, 10, device="cuda"), torch.ones(8, 10))
scaler.scale(loss).backward()
scaler.unscale_(opt)
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(opt)
scaler.update()


def padded_softmax(logits, y):
    probs = torch.softmax(logits, -1)
    nll = -(y * torch.log(probs + 1e-8)).sum()  # expect: log-of-softmax
    ratio = (y / (probs + 1e-8)).sum()  # expect: eps-underflow
    return nll + ratio
