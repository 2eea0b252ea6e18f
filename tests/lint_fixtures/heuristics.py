"""The info-level heuristics: sqrt/acos at a singular point, division by a bare sum or norm."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def pairwise_distance(a, b):
    return torch.sqrt(((a - b) ** 2).sum(-1))  # expect: nondifferentiable-point


def safe_distance(a, b):
    d1 = torch.linalg.vector_norm(a - b, dim=-1)
    d2 = torch.sqrt(((a - b) ** 2).sum(-1) + 1e-6)
    d3 = (a - b).norm(dim=-1)
    return d1 + d2 + d3


class Embedder(nn.Module):
    def forward(self, x, mask):
        unit = x / x.norm(dim=-1, keepdim=True)  # expect: division-by-zero
        total = (x * mask[..., None]).sum(1)
        pooled = total / mask.sum(1, keepdim=True)  # expect: division-by-zero
        rms = x.pow(2).mean(-1).sqrt()  # expect: nondifferentiable-point
        cos = F.cosine_similarity(unit, pooled, dim=-1)
        angle = torch.acos(cos)  # expect: nondifferentiable-point
        safe = torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6))
        denom = mask.sum()
        mean = x.sum() / denom  # expect: division-by-zero
        guarded = x.sum() / mask.sum().clamp_min(1)
        weights = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)
        gates = torch.sigmoid(x)
        gates = gates / gates.sum(-1, keepdim=True)
        return unit, pooled, rms, angle, safe, mean, guarded, weights, gates


def loss_fn(model, x, y):
    d = pairwise_distance(model(x), y)
    return d.mean()


def step(model, opt, x, y):
    loss = loss_fn(model, x, y)
    loss.backward()
    opt.step()


def load_features(raw):
    degree = raw.sum(1)
    return raw / degree[:, None]


@torch.no_grad()
def evaluate(model, x, y):
    cos = F.cosine_similarity(model(x), y)
    return torch.acos(cos).mean(), (x / x.norm()).mean()


def rescale(grad, norm):
    if norm > 1.0:
        grad = grad / norm
    return grad
