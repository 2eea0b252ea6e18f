"""Findings silenced on their line, by id or for every check."""

import torch

probs = torch.softmax(torch.randn(4, 3), -1)
a = torch.log(probs)  # nandoctor: ignore[log-of-softmax]
b = torch.log(probs)  # nandoctor: ignore
c = torch.log(probs)  # nandoctor: ignore[eps-underflow]  # expect: log-of-softmax
d = torch.log(  # nandoctor: ignore[log-of-softmax, division-by-zero]
    probs
)
text = "torch.log(probs)  # nandoctor: ignore"
e = torch.log(probs)  # expect: log-of-softmax
