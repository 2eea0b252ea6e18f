"""Tiny random-init transformers models whose designed failures need a what-if that is
more than a config change (tests/e2e/test_real_fixes.py):

- GPT-2 cast to float16 (`.half()`), resumed with Adam from a checkpoint saved in
  float32 training: `optimizer.load_state_dict` casts the moments to float16 and brings
  back the eps they were saved with, 1e-8, which is 0 in float16. A vocabulary row no
  batch used has both moments 0: its update is 0 / (0 + 0) = NaN at the first step. The
  config's own `eps` changes nothing: the checkpoint's wins.
- A SimCSE-style sentence encoder on GPT-2: each sentence and a copy of it with one word
  dropped are a positive pair, scored by cosine similarity times `exp(logit_scale)`, a
  learnable scale as in CLIP. The pairs are easy, so a sharper scale always lowers the
  loss; trained at the rate of the other weights times SCALE_RATE (scalars get a fast
  rate, no decay), `logit_scale` climbs until exp overflows float32 (at ~88.7). CLIP
  clamps it at ln(100) after each step; this loop does not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import real_models

SCALE_RATE = 30000.0


def gpt2_half() -> Any:
    return real_models.gpt2(dropout=0.0).half()


def save_float32_checkpoint(path: Path, steps: int = 3) -> None:
    """What the run resumes from: GPT-2 trained in float32 with Adam (eps 1e-8)."""
    torch.manual_seed(0)
    model = real_models.gpt2(dropout=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for batch in real_models.lm_data(batches=steps):
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": steps}
    torch.save(state, path)


class SentenceEncoder(nn.Module):
    """GPT-2's hidden states, mean-pooled and normalised; a learnable logit scale."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = real_models.gpt2(dropout=0.0).transformer
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))  # ln(1 / 0.07), CLIP's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.encoder(input_ids=ids).last_hidden_state.mean(1), dim=-1)


def sentence_encoder() -> nn.Module:
    return SentenceEncoder()


def sentence_pairs(batches: int = 8, batch: int = 8, seq: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, real_models.VOCAB, (batch, seq), generator=g) for _ in range(batches)]


def contrastive_loss(model: SentenceEncoder, ids: torch.Tensor) -> torch.Tensor:
    """Each sentence against every other's view with its last word dropped."""
    a, b = model(ids), model(ids[:, :-1])
    logits = model.logit_scale.exp() * a @ b.T  # marker:logit-scale-exp
    return F.cross_entropy(logits, torch.arange(len(ids)))


def fast_scalars(params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    """AdamW, with the scalar parameters (the logit scale) at SCALE_RATE times the rate
    and no weight decay."""
    params = list(params)
    scalars = [p for p in params if p.ndim == 0]
    others = [p for p in params if p.ndim > 0]
    groups = [{"params": others}, {"params": scalars, "lr": lr * SCALE_RATE, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr)
