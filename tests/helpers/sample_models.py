"""A tiny random-init BERT that pools each document's tokens by hand, over a DataLoader of
documents, for the samples tests (tests/localize/test_samples.py): one document of the corpus is
empty (all padding), and its mean pooling divides 0 by 0 in the user's loss.

A config names these as `tests.helpers.sample_models:<builder>`; transformers is imported inside
them, so importing this module costs nothing where transformers is missing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

VOCAB = 64
EMPTY = 37  # the dataset index of the empty document


def bert(layers: int = 1, dim: int = 32, heads: int = 2) -> Any:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=2 * dim,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    config._attn_implementation = "eager"
    return BertModel(config)


class Documents(Dataset):
    """Token ids padded to `length`, each with a score to regress; document `empty` has
    no tokens at all (its attention mask is all zero)."""

    def __init__(self, size: int = 96, length: int = 12, empty: int | None = EMPTY) -> None:
        g = torch.Generator().manual_seed(4)
        self.ids = torch.randint(1, VOCAB, (size, length), generator=g)
        lengths = torch.randint(3, length + 1, (size,), generator=g)
        self.mask = (torch.arange(length) < lengths[:, None]).long()
        if empty is not None:
            self.mask[empty] = 0
        self.ids = self.ids * self.mask
        self.score = torch.randn(size, generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "score": self.score[i]}


def collate(items: list[dict[str, torch.Tensor]]) -> Any:
    """The batch as a tokenizer returns one: a `BatchEncoding`."""
    from transformers import BatchEncoding

    return BatchEncoding({key: torch.stack([item[key] for item in items]) for key in items[0]})


def documents(batch_size: int = 8, empty: int | None = EMPTY) -> DataLoader:
    return DataLoader(
        Documents(empty=empty),
        batch_size=batch_size,
        shuffle=True,
        generator=torch.Generator().manual_seed(11),
        collate_fn=collate,
    )


def mean_pooled_loss(model: Any, batch: Any) -> torch.Tensor:
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    mask = batch["attention_mask"].unsqueeze(-1).float()
    # designed: an empty document pools 0 tokens: 0 / 0
    pooled = (hidden.last_hidden_state * mask).sum(1) / mask.sum(1)  # marker:mean-pool
    return torch.nn.functional.mse_loss(pooled.mean(-1), batch["score"])
