"""Every spelling of a hand-written log of a softmax."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import log
from torch.nn import functional as functional_alias
from torch.nn.functional import softmax as sm

functional = torch.nn.functional


def direct(logits, y):
    a = torch.log(torch.softmax(logits, -1))  # expect: log-of-softmax
    b = torch.log(F.softmax(logits, dim=-1))  # expect: log-of-softmax
    c = log(sm(logits, dim=1))  # expect: log-of-softmax
    d = torch.log(functional_alias.softmax(logits, 1))  # expect: log-of-softmax
    e = torch.log(functional.softmax(logits, 1))  # expect: log-of-softmax
    f = torch.nn.functional.softmax(logits, -1).log()  # expect: log-of-softmax
    g = logits.softmax(-1).log()  # expect: log-of-softmax
    h = torch.log2(logits.softmax(dim=-1))  # expect: log-of-softmax
    return a + b + c + d + e + f + g + h


def through_a_variable(logits, y):
    probs = F.softmax(logits, dim=-1)
    confidence = probs.max(-1).values
    picked = probs.gather(1, y[:, None]).squeeze(1)
    nll = -torch.log(picked).mean()  # expect: log-of-softmax
    kl = F.kl_div(probs.log(), y, reduction="batchmean")  # expect: log-of-softmax
    entropy = -(probs * torch.log(probs[:, :9])).sum(-1)  # expect: log-of-softmax
    return nll + kl + entropy + confidence


def with_an_epsilon(logits, y):
    probs = torch.softmax(logits, dim=-1)
    loss = -(y * torch.log(probs + 1e-8)).sum(-1).mean()  # expect: log-of-softmax
    eps = 1e-6
    other = (1e-9 + probs).log().mean()  # expect: log-of-softmax
    return loss + other + torch.log(probs + eps).mean()  # expect: log-of-softmax


def by_hand(logits):
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    p = e / e.sum(-1, keepdim=True)
    return torch.log(p)  # expect: log-of-softmax


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 4)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x, y):
        probs = self.softmax(self.proj(x))
        return F.nll_loss(torch.log(probs), y)  # expect: log-of-softmax


def module_built_inline(x, y):
    return F.nll_loss(torch.log(nn.Softmax(dim=1)(x)), y)  # expect: log-of-softmax


probs = F.softmax(torch.randn(4, 3), dim=-1)
loss = -torch.log(probs).mean()  # expect: log-of-softmax


def handwritten_binary_cross_entropy(logits, y):
    p = torch.sigmoid(logits)
    pos = y * torch.log(p)  # expect: log-of-softmax
    neg = (1 - y) * torch.log(1 - p)  # expect: log-of-zero
    return -(pos + neg).mean() + torch.log(1.0 - logits.sigmoid()).sum()  # expect: log-of-zero
