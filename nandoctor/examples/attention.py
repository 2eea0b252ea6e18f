"""A small transformer text classifier with hand-written multi-head attention that
masks the padding keys with -inf before the softmax::

    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    attn = scores.softmax(-1)

That is right for every text with at least one real token. The preprocessing strips
URLs and mentions, and a post that held nothing else comes out as a sequence of
padding only: every key of its rows is masked, softmax over a row of -inf is
exp(-inf) / sum(exp(-inf)) = 0 / 0 = NaN, and the NaN spreads through the rest of the
model. The first empty post arrives after some clean steps.

The fix is to drop empty sequences, or to mask with a large finite negative
(`torch.finfo(scores.dtype).min`) and zero the fully-masked rows, or to call
`F.scaled_dot_product_attention`, whose math kernel returns 0 for a fully masked row
(`nn.MultiheadAttention` with a full `key_padding_mask` still gives NaN).
`empty_every=0` (configs/attention-masked-ok.yaml) is the same run without empty posts.
"""

from __future__ import annotations

import math

import torch
from torch import nn

PAD = 0


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))  # padding keys
        attn = scores.softmax(-1)  # NaN for a row whose keys are all padding
        return self.out((attn @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), keep)
        return x + self.mlp(self.norm2(x))


class TextClassifier(nn.Module):
    def __init__(
        self,
        vocab: int = 500,
        dim: int = 64,
        heads: int = 4,
        layers: int = 2,
        max_len: int = 32,
        classes: int = 3,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != PAD
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, keep)
        w = keep.unsqueeze(-1).to(x.dtype)
        pooled = (self.norm(x) * w).sum(1) / w.sum(1).clamp(min=1)
        return self.head(pooled)


def build_model(vocab: int = 500, dim: int = 32, layers: int = 2) -> nn.Module:
    return TextClassifier(vocab=vocab, dim=dim, layers=layers)


def build_data(
    batches: int = 16,
    batch_size: int = 16,
    vocab: int = 500,
    max_len: int = 24,
    classes: int = 3,
    empty_every: int = 13,
    seed: int = 8,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Posts as token ids padded with PAD; the class is told by a few keywords.

    Every `empty_every`-th batch holds one post that preprocessing emptied (0: none).
    """
    g = torch.Generator().manual_seed(seed)
    keywords = torch.randint(1, vocab, (classes, 8), generator=g)
    data = []
    for i in range(batches):
        y = torch.randint(0, classes, (batch_size,), generator=g)
        tokens = torch.randint(1, vocab, (batch_size, max_len), generator=g)
        hits = torch.rand(batch_size, max_len, generator=g) < 0.2
        picked = keywords[y[:, None], torch.randint(0, 8, (batch_size, max_len), generator=g)]
        tokens = torch.where(hits, picked, tokens)
        lengths = torch.randint(4, max_len + 1, (batch_size,), generator=g)
        tokens[torch.arange(max_len) >= lengths[:, None]] = PAD
        if empty_every and i % empty_every == empty_every - 1:
            tokens[5] = PAD  # a post that was only a URL: nothing left after cleaning
        data.append((tokens, y))
    return data
