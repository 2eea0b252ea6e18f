"""The forecast's calibration corpus: runs that fail by growth, and healthy runs that must
carry no forecast. Small CPU models and transformers' tiny configs, each a nandoctor
config built in memory (`benchmarks.forecast` runs them; docs/forecast.md has the table).

Growth failures, each by a different road to a non-finite value:

- seed-fp16-nan: the shipped example (configs/seed-fp16-nan.yaml): logits grow under a
  high learning rate until softmax underflows in float16 and log(0) is -inf;
- house-prices-fp16: configs/fp16-overflow.yaml: a regression on raw dollars whose head
  climbs past float16's 65504;
- ema-rnn-fp32: configs/exploding-gradients.yaml: an unclipped recurrent net whose
  gradients explode until float32 overflows;
- ridge-sgd-fp32: least squares under SGD just past its stable rate: each step
  overshoots further, the loss grows geometrically until it overflows float32;
- ridge-sgd-fp16-scaler: the same overshoot under float16 autocast and a GradScaler:
  the growing gradients overflow the scaled float16 more and more often, each skip
  halves the scale, and the scale collapses;
- classifier-logsoftmax-fp16: a clean, confident classifier with a hand-written
  log(softmax) under float16: its logits spread until a probability underflows;
- gpt2-logsoftmax-fp16: transformers' tiny GPT-2 learning to count, its loss a
  hand-written log of the softmax (tests/helpers/real_models.py), in float16;
- deep-linear-fp32: a deep linear net under SGD at a high rate: bursts of instability
  (the edge of stability), each larger than the last, until one overflows float32;
- embeddings-fp16: a similarity objective on unnormalised embeddings (a contrastive loss
  that forgot to normalise): their norms grow without end until float16 overflows.

Healthy runs, each a way a run looks alarming without failing:

- seed-fixed: configs/seed-fixed.yaml: float16 with 8 GradScaler calibration skips;
- attention-masked-ok: configs/attention-masked-ok.yaml: padding masks at -inf;
- mlp-warmup-cosine-fp32: a linear warmup then a cosine decay (AdamW);
- mlp-fp16-calibration: float16 from init_scale 2**24: a long streak of calibration skips;
- plateau-fp32: a regression on pure noise: the loss falls to its floor and stays;
- classifier-logsoftmax-fp32: the hand-written log(softmax), in float32 (limit 104);
- classifier-logsoftmax-noisy-fp16: the same in float16 with noisy labels: its logits
  grow, then level off below the underflow;
- gpt2-warmup-fp32: tiny GPT-2 language modelling, warmup and cosine;
- bert-mlm-fp32: tiny BERT masked language modelling (eager attention, additive masks);
- llama-fp16-high-lr: tiny Llama (RMSNorm, SwiGLU, eager attention) in float16 under Adam
  at 5e-2: its activations and attention logits shoot up for 20 steps, then level off;
- llama-bf16: tiny Llama in bfloat16 with warmup.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CorpusRun:
    name: str
    growth: bool  # a run that fails by growth (False: a healthy run)
    config: dict[str, Any] = field(default_factory=dict)  # None: `shipped`'s file
    shipped: str | None = None  # a config of configs/, run as it is


def _run(name: str, growth: bool, **config: Any) -> CorpusRun:
    base = {"device": "cpu", "seed": 0, "precision": {"dtype": "float32"}}
    return CorpusRun(name, growth, {"name": name, **base, **config})


# -- models and data -----------------------------------------------------------------------
class ResMLP(nn.Module):
    """Residual blocks with no normalisation: x = x + W2 relu(W1 x)."""

    def __init__(self, features: int = 16, width: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h).squeeze(-1)


def build_resmlp(features: int = 16, width: int = 64, blocks: int = 4) -> nn.Module:
    return ResMLP(features, width, blocks)


def build_linear(features: int = 16) -> nn.Module:
    return nn.Linear(features, 1)


def build_deep_linear(features: int = 16, width: int = 32, depth: int = 8) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(features, width)]
    layers += [nn.Linear(width, width) for _ in range(depth - 2)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def build_classifier(features: int = 32, hidden: int = 128, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, classes),
    )  # fmt: skip


def regression_data(
    batches: int = 16, batch_size: int = 64, features: int = 16, noise: float = 0.1,
    scale: float = 1.0, signal: bool = True, seed: int = 3,
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """y = x . w (+ noise); `signal=False`: y is the noise alone (the loss plateaus)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, generator=g)
    out = []
    for _ in range(batches):
        x = torch.randn(batch_size, features, generator=g) * scale
        y = (x @ w if signal else 0) + noise * torch.randn(batch_size, generator=g)
        out.append((x, y))
    return out


def pairs_data(
    batches: int = 16, batch_size: int = 64, features: int = 16, seed: int = 5
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two noisy views of the same points, for a similarity objective."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        x = torch.randn(batch_size, features, generator=g)
        out.append((x + 0.1 * torch.randn(x.shape, generator=g), x))
    return out


def unnormalised_similarity(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    """A contrastive-style objective that forgot to normalise its embeddings: the dot
    product of two views' embeddings rewards their norms, which grow without end."""
    a, b = batch
    return -(model(a).float() * model(b).float()).sum(-1).mean()


def build_embedder(features: int = 16, width: int = 64, out: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, out))


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x).reshape(-1).float(), y)


def classes_data(
    batches: int = 16, batch_size: int = 64, features: int = 32, classes: int = 10,
    separation: float = 3.0, label_noise: float = 0.0, seed: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Gaussian clusters, one-hot targets (`label_noise` of them redrawn at random)."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=g) * separation
    out = []
    for _ in range(batches):
        y = torch.randint(0, classes, (batch_size,), generator=g)
        x = centers[y] + torch.randn(batch_size, features, generator=g)
        flip = torch.rand(batch_size, generator=g) < label_noise
        y = torch.where(flip, torch.randint(0, classes, (batch_size,), generator=g), y)
        out.append((x, F.one_hot(y, classes).float()))
    return out


def log_softmax_by_hand(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    x, y = batch
    return -(y * torch.log(torch.softmax(model(x), -1))).sum(-1).mean()


def cross_entropy(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Any:
    x, y = batch
    return F.cross_entropy(model(x), y)


def llama(layers: int = 2, dim: int = 32, heads: int = 2) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=32,
    )  # fmt: skip
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup: int = 20, total: int = 200) -> Any:
    """A linear warmup over `warmup` steps, then a cosine decay to 0 at `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


HERE = "benchmarks.forecast_corpus"
REAL = "tests.helpers.real_models"
SCHEDULE = {"factory": f"{HERE}:warmup_cosine"}
FP16 = {"dtype": "float16", "autocast_policy": "native"}


def corpus() -> list[CorpusRun]:
    return [
        CorpusRun("seed-fp16-nan", True, shipped="seed-fp16-nan.yaml"),
        CorpusRun("house-prices-fp16", True, shipped="fp16-overflow.yaml"),
        CorpusRun("ema-rnn-fp32", True, shipped="exploding-gradients.yaml"),
        _run(
            "embeddings-fp16",
            True,
            model=f"{HERE}:build_embedder",
            data=f"{HERE}:pairs_data",
            loss=f"{HERE}:unnormalised_similarity",
            optimizer={"name": "SGD", "lr": 1e-3},
            precision=FP16,
            steps=400,
        ),
        _run(
            "ridge-sgd-fp32",
            True,
            model=f"{HERE}:build_linear",
            data=f"{HERE}:regression_data",
            loss=f"{HERE}:mse",
            optimizer={"name": "SGD", "lr": 1.15},
            steps=600,
        ),
        _run(
            "ridge-sgd-fp16-scaler",
            True,
            model=f"{HERE}:build_linear",
            data=f"{HERE}:regression_data",
            loss=f"{HERE}:mse",
            optimizer={"name": "SGD", "lr": 1.15},
            precision=FP16,
            steps=600,
        ),
        _run(
            "classifier-logsoftmax-fp16",
            True,
            model=f"{HERE}:build_classifier",
            data=f"{HERE}:classes_data",
            loss=f"{HERE}:log_softmax_by_hand",
            optimizer={"name": "SGD", "lr": 0.01, "momentum": 0.9},
            precision=FP16,
            steps=400,
        ),
        _run(
            "gpt2-logsoftmax-fp16",
            True,
            model=f"{REAL}:gpt2",
            model_args={"dropout": 0.0},
            data=f"{REAL}:counting_data",
            loss=f"{REAL}:gpt2_hand_written_log_softmax_loss",
            optimizer={"name": "AdamW", "lr": 3e-2},
            precision=FP16,
            steps=120,
        ),
        _run(
            "deep-linear-fp32",
            True,
            model=f"{HERE}:build_deep_linear",
            data=f"{HERE}:regression_data",
            loss=f"{HERE}:mse",
            optimizer={"name": "SGD", "lr": 0.07},
            steps=400,
        ),
        # -- healthy --------------------------------------------------------------------
        CorpusRun("seed-fixed", False, shipped="seed-fixed.yaml"),
        CorpusRun("attention-masked-ok", False, shipped="attention-masked-ok.yaml"),
        _run(
            "mlp-warmup-cosine-fp32",
            False,
            model=f"{HERE}:build_classifier",
            data=f"{HERE}:classes_data",
            data_args={"label_noise": 0.2},
            loss=f"{HERE}:cross_entropy",
            optimizer={"name": "AdamW", "lr": 3e-3},
            scheduler=SCHEDULE,
            steps=200,
        ),
        _run(
            "mlp-fp16-calibration",
            False,
            model=f"{HERE}:build_classifier",
            data=f"{HERE}:classes_data",
            data_args={"label_noise": 0.2},
            loss=f"{HERE}:cross_entropy",
            optimizer={"name": "AdamW", "lr": 1e-3},
            precision={**FP16, "init_scale": 2.0**24},
            steps=300,
        ),
        _run(
            "plateau-fp32",
            False,
            model=f"{HERE}:build_resmlp",
            data=f"{HERE}:regression_data",
            data_args={"signal": False, "noise": 1.0},
            loss=f"{HERE}:mse",
            optimizer={"name": "Adam", "lr": 1e-3},
            steps=300,
        ),
        _run(
            "classifier-logsoftmax-fp32",
            False,
            model=f"{HERE}:build_classifier",
            data=f"{HERE}:classes_data",
            loss=f"{HERE}:log_softmax_by_hand",
            optimizer={"name": "SGD", "lr": 0.05, "momentum": 0.9},
            steps=300,
        ),
        _run(
            "classifier-logsoftmax-noisy-fp16",
            False,
            model=f"{HERE}:build_classifier",
            data=f"{HERE}:classes_data",
            data_args={"label_noise": 0.3},
            loss=f"{HERE}:log_softmax_by_hand",
            optimizer={"name": "SGD", "lr": 0.02, "momentum": 0.9},
            precision=FP16,
            steps=300,
        ),
        _run(
            "gpt2-warmup-fp32",
            False,
            model=f"{REAL}:gpt2",
            model_args={"dropout": 0.0},
            data=f"{REAL}:lm_data",
            data_args={"batches": 8},
            loss=f"{REAL}:lm_loss",
            optimizer={"name": "AdamW", "lr": 3e-3},
            scheduler={**SCHEDULE, "warmup": 10, "total": 120},
            steps=120,
        ),
        _run(
            "bert-mlm-fp32",
            False,
            model=f"{REAL}:bert",
            data=f"{HERE}:mlm_data",
            loss=f"{REAL}:mlm_loss",
            optimizer={"name": "AdamW", "lr": 1e-3},
            steps=100,
        ),
        _run(
            "llama-fp16-high-lr",
            False,
            model=f"{HERE}:llama",
            data=f"{REAL}:lm_data",
            loss=f"{REAL}:lm_loss",
            optimizer={"name": "Adam", "lr": 5e-2},
            precision=FP16,
            steps=200,
        ),
        _run(
            "llama-bf16",
            False,
            model=f"{HERE}:llama",
            data=f"{REAL}:lm_data",
            data_args={"batches": 8},
            loss=f"{REAL}:lm_loss",
            optimizer={"name": "AdamW", "lr": 3e-3},
            scheduler={**SCHEDULE, "warmup": 10, "total": 120},
            precision={"dtype": "bfloat16", "autocast_policy": "native"},
            steps=120,
        ),
    ]


def mlm_data(batches: int = 8, batch: int = 4, seq: int = 12) -> list[dict[str, torch.Tensor]]:
    """tests.helpers.real_models' masked-language batches, every one with masked positions."""
    real = importlib.import_module(REAL)  # NB: the suite's models, as a config names them
    made = real.mlm_data(batches + 1, batch, seq)
    good = [b for i, b in enumerate(made) if i != real.BAD_STEP]
    return good[:batches]


__all__ = ["CorpusRun", "corpus"]
