"""A dual-encoder for search (queries and documents embedded into one space, trained
with an in-batch contrastive loss, CLIP-style). Each text is a bag of word embeddings,
averaged over its real tokens, projected, and L2-normalised by hand::

    pooled = emb.sum(1) / mask.sum(1, keepdim=True).clamp(min=1)   # careful here...
    z = self.proj(pooled)                                          # no bias, as in CLIP
    return z / z.norm(dim=-1, keepdim=True)                        # ...but not here

A query whose words were all stop words or out of the vocabulary tokenises to nothing
but padding: its pooled vector is exactly 0 (the padding embedding is 0, the mean's
denominator was clamped), the bias-free projection keeps it 0, and the normalisation
computes 0 / 0 = NaN. The first such query arrives after some clean steps.

The fix is `F.normalize(z, dim=-1)` (it divides by `norm.clamp_min(1e-12)`), and
dropping empty queries from the data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PAD = 0


class BagEncoder(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = (tokens != PAD).unsqueeze(-1)
        pooled = (self.embed(tokens) * mask).sum(1) / mask.sum(1).clamp(min=1)
        z = self.proj(pooled)
        return z / z.norm(dim=-1, keepdim=True)  # BUG: 0 / 0 for an empty text


class DualEncoder(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 64, temperature: float = 0.05) -> None:
        super().__init__()
        self.query = BagEncoder(vocab, dim)
        self.doc = BagEncoder(vocab, dim)
        self.temperature = temperature

    def forward(self, queries: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
        return self.query(queries) @ self.doc(docs).T / self.temperature


def build_model(vocab: int = 1000, dim: int = 64) -> nn.Module:
    return DualEncoder(vocab, dim)


def build_data(
    batches: int = 16,
    batch_size: int = 32,
    vocab: int = 1000,
    doc_len: int = 24,
    query_len: int = 6,
    empty_query_at: int | None = 11,
    seed: int = 4,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(queries, documents), padded with PAD; a query is a few words of its document.

    Batch `empty_query_at` holds one query that tokenised to nothing (all padding).
    """
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(batches):
        docs = torch.randint(1, vocab, (batch_size, doc_len), generator=g)
        lengths = torch.randint(2, query_len + 1, (batch_size,), generator=g)
        picks = torch.rand(batch_size, doc_len, generator=g).argsort(-1)[:, :query_len]
        queries = docs.gather(1, picks)
        queries[torch.arange(query_len) >= lengths[:, None]] = PAD
        if i == empty_query_at:
            queries[7] = PAD  # "the of and": every word dropped by the tokenizer
        data.append((queries, docs))
    return data


def contrastive_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    queries, docs = batch
    logits = model(queries, docs)
    target = torch.arange(len(queries))
    return F.cross_entropy(logits, target)
