"""Tiny random-init transformers models, each with a failure designed into the user's
loss or data, for the tests on real architectures (tests/e2e/test_real_models.py).

A config names these as `tests.helpers.real_models:<builder>`. transformers is imported inside
the builders, so importing this module costs nothing where transformers is missing.

- GPT-2 with SDPA attention and dropout: its dropout writes into `empty_like` buffers
  (garbage until written), and the user's consistency term takes `sqrt` at 0, whose
  derivative is infinite: a NaN born in the backward.
- T5 with relative position buckets: every forward takes `log(0)` on the diagonal of
  the relative positions and discards it (the cast to integer buckets); at step 1 the
  user's loss normalises a masked-mean pooling of an all-padding example: 0/0.
- GPT-2 in float16 learning an easy sequence (each row counts up), its loss a
  hand-written log of the softmax: once the model is sure, a probability underflows to
  exactly 0; the gather of the target's column discards log(0) = -inf, and the backward
  of log divides by that 0: 0/0, a NaN the GradScaler skips as if it were an overflow.
- GPT-2 in float16 with one MLP's input weights scaled up: its GELU (transformers'
  NewGELU, tanh of x + 0.044715 x^3) takes pow(x, 3), whose backward 3 x^2 overflows
  float16: an overflow in the backward of pow, with no singular point anywhere.
- GPT-2 in float16 with a hand-written InfoNCE term: `exp` of raw similarities
  overflows float16 (above ~11.1), `e.diag() / e.sum(-1)` turns that inf into an exact
  0, and the log of it fails: an overflow that healed into the failure.
- BERT (eager attention, padding masks filled with the dtype's minimum) for masked
  language modelling: at step 1 no token of the batch was masked, so every label is
  -100 and the library's cross-entropy averages over nothing: 0/0 inside
  torch.nn.functional, called from transformers' modeling file.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
BAD_STEP = 1  # the step whose batch carries the designed failure (T5, BERT)


def gpt2(layers: int = 2, dim: int = 32, heads: int = 2, dropout: float = 0.1) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=layers,
        n_embd=dim,
        n_head=heads,
        vocab_size=VOCAB,
        n_positions=32,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    config._attn_implementation = "sdpa"
    return GPT2LMHeadModel(config)


def lm_data(batches: int = 4, batch: int = 4, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(batches):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def gpt2_consistency_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    logits = out.logits.float()
    # designed: the distance to a detached copy of itself is 0, and sqrt'(0) is infinite
    distance = torch.sqrt(((logits - logits.detach()) ** 2).sum())  # marker:gpt2-sqrt
    return out.loss + 1e-3 * distance


def t5(dim: int = 32, heads: int = 2, dropout: float = 0.1) -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=dim,
        d_kv=dim // heads,
        d_ff=2 * dim,
        num_layers=1,
        num_decoder_layers=1,
        num_heads=heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=dropout,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(config)


def seq2seq_data(batches: int = 4, batch: int = 4, seq: int = 10) -> list[dict[str, torch.Tensor]]:
    """At BAD_STEP, the last example is all padding (its attention mask all zero)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        ids = torch.randint(1, VOCAB, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[:, seq - 2 :] = 0
        if i == BAD_STEP:
            mask[-1] = 0
        labels = torch.randint(1, VOCAB, (batch, seq // 2), generator=g)
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return out


def t5_contrastive_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch)
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (out.encoder_last_hidden_state * mask).sum(1)
    # designed: an all-padding example pools to a zero vector, and 0 / ||0|| is NaN
    unit = pooled / pooled.norm(dim=-1, keepdim=True)  # marker:t5-norm
    return out.loss + 0.01 * (unit @ unit.T).mean()


def bert(layers: int = 2, dim: int = 32, heads: int = 2) -> Any:
    from transformers import BertConfig, BertForMaskedLM

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
    config._attn_implementation = "eager"  # the additive mask: the dtype's minimum
    return BertForMaskedLM(config)


def mlm_data(batches: int = 4, batch: int = 4, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    """Padding at the end of each row; at BAD_STEP no position was picked for masking."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        ids = torch.randint(5, VOCAB, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        mask[1:, seq - 3 :] = 0
        picked = (torch.rand(batch, seq, generator=g) < 0.3) & mask.bool()
        if i == BAD_STEP:
            picked[:] = False
        labels = torch.where(picked, ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return out


def mlm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss  # marker:bert-loss


SHARPEN = 0.0075  # the temperature of `gpt2_sharpened_loss`'s targets


def gpt2_sharpened_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Self-distillation towards the model's own sharpened predictions, the softmax at a
    low temperature written by hand. Designed: as the logits grow in training, exp of
    logits / 0.004 passes float32's range (exp overflows above ~88.7): inf / inf is NaN."""
    out = model(**batch)
    logits = out.logits.float()
    weights = torch.exp(logits.detach() / SHARPEN)  # marker:gpt2-exp
    target = weights / weights.sum(-1, keepdim=True)
    return out.loss - 0.1 * (target * torch.log_softmax(logits, -1)).sum(-1).mean()


def counting_data(batches: int = 4, batch: int = 4, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    """Rows that count up (mod VOCAB) from a random start: the next token is certain."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(batches):
        ids = (torch.randint(0, VOCAB, (batch, 1), generator=g) + torch.arange(seq)) % VOCAB
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def gpt2_hand_written_log_softmax_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    probs = torch.softmax(logits, dim=-1)
    log_probs = torch.log(probs)  # marker:gpt2-log
    return -log_probs.gather(-1, batch["labels"][:, 1:].unsqueeze(-1)).mean()


def gpt2_with_a_hot_mlp(scale: float = 3000.0) -> Any:
    model = gpt2(dropout=0.0)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(scale)
    return model


def lm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def gpt2_info_nce_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    out = model(**batch, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    similarity = hidden[:, 0] @ hidden[:, -1].t()
    e = torch.exp(similarity)  # marker:gpt2-info-nce-exp
    return out.loss - 0.1 * torch.log(e.diag() / e.sum(-1)).mean()  # marker:gpt2-info-nce-log
