"""-inf masks that reach a softmax: padding masks (flagged) and causal or top-k masks."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def padded_attention(q, k, v, key_padding_mask):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    pad = key_padding_mask[:, None, :]
    scores = scores.masked_fill(pad, float("-inf"))  # expect: fully-masked-softmax
    return torch.softmax(scores, dim=-1) @ v


def additive_mask(q, k, pad):
    bias = torch.zeros(pad.shape, dtype=q.dtype)
    bias[pad] = -math.inf  # expect: fully-masked-softmax
    scores = q @ k.transpose(-2, -1) + bias[:, None, :]
    return F.softmax(scores, dim=-1)


def in_place(scores, mask):
    scores.masked_fill_(mask, -float("inf"))  # expect: fully-masked-softmax
    return scores.softmax(-1)


def with_where(scores, keep):
    masked = torch.where(keep, scores, -torch.inf)  # expect: fully-masked-softmax
    return F.softmax(masked, dim=-1)


def finite_fill(scores, mask):
    scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1)


def never_reaches_a_softmax(scores, mask):
    return scores.masked_fill(mask, float("-inf")).amax(-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, block_size):
        super().__init__()
        ones = torch.ones(block_size, block_size)
        self.register_buffer("bias", torch.tril(ones).view(1, 1, block_size, block_size))

    def forward(self, q, k):
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return F.softmax(att, dim=-1)


def causal_local_mask(scores):
    T = scores.size(-1)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    return scores.softmax(-1)


def top_k_filter(logits, k):
    v, _ = torch.topk(logits, k)
    logits[logits < v[:, [-1]]] = -float("inf")
    return F.softmax(logits, dim=-1)


@torch.no_grad()
def generate(logits, banned):
    logits = logits.masked_fill(banned, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1)
