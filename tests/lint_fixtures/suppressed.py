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
# a formatter's wrapped call: the comment on its first or its closing line covers it
f = torch.nn.functional.nll_loss(  # nandoctor: ignore[log-of-softmax]
    torch.log(probs),
    torch.tensor([0, 1, 2, 0]),
)
g = torch.nn.functional.nll_loss(
    torch.log(probs),
    torch.tensor([0, 1, 2, 0]),
)  # nandoctor: ignore[log-of-softmax]
# a compound statement's comment covers its header, not its body
if torch.log(probs).sum() > 0:  # nandoctor: ignore[log-of-softmax]
    h = torch.log(probs)  # expect: log-of-softmax
