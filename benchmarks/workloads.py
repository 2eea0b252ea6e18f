"""Realistic CPU workloads in plain torch: an MLP, a small decoder-only transformer and a
small conv net, with float16 + GradScaler, bfloat16 or float32, at three sizes.

NB: float32 is measured too. A CPU without AVX512-BF16 (or AMX) emulates bfloat16 matmuls
slowly, and float16 ones slower still: the plain step grows and every overhead ratio
shrinks. float32 steps run at the CPU's full speed, so they show the sentinel's cost as
users of such CPUs (and of GPUs, where every dtype is fast) meet it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # NB: the plain loop's set-up (`measure.start_up`) imports the models here,
    from nandoctor.setup.load import LoadedConfig  # and a plain script loads no config model

# size -> knobs; "tiny" keeps the smoke test fast, "gpu" is for benchmarks/gpu_check.sh
SIZES = {
    "tiny": {"width": 32, "layers": 2, "seq": 16, "batch": 4, "vocab": 64, "image": 8},
    "cpu": {"width": 128, "layers": 4, "seq": 128, "batch": 8, "vocab": 512, "image": 32},
    "gpu": {"width": 512, "layers": 8, "seq": 512, "batch": 16, "vocab": 8192, "image": 64},
}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """A small GPT: token and position embeddings, causal blocks, a tied-size head."""

    def __init__(self, vocab: int, width: int, layers: int, seq: int, **_: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(Block(width, 4) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        # NB: an additive float mask, large but finite: -inf is a NaN risk of its own, and
        # transformers' DebugUnderflowOverflow cannot inspect boolean tensors
        self.register_buffer("mask", torch.triu(torch.full((seq, seq), -1e9), 1))

    def forward(self, idx: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) * scale + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x, self.mask)
        return self.head(self.ln(x))


def build_mlp(width: int, layers: int, **_: int) -> nn.Module:
    mods: list[nn.Module] = [nn.Linear(64, width * 4), nn.ReLU()]
    for _layer in range(layers - 1):
        mods += [nn.Linear(width * 4, width * 4), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width * 4, 10))


def build_convnet(width: int, **_: int) -> nn.Module:
    c = max(8, width // 8)
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(2 * c, 10),
    )  # fmt: skip


def mlp_data(batch: int, steps: int = 64, nan_at: int | None = None, **_: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(steps):
        x = torch.randn(batch * 8, 64, generator=g)
        if i == nan_at:
            x[0, 0] = float("nan")
        out.append((x, torch.randint(0, 10, (batch * 8,), generator=g)))
    return out


def text_data(
    batch: int, seq: int, vocab: int, steps: int = 64, nan_at: int | None = None, **_: int
) -> list:
    """Token batches; `scale` multiplies the embeddings (a NaN there is a bad input)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(steps):
        idx = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        scale = torch.tensor(float("nan") if i == nan_at else 1.0)
        out.append((idx[:, :-1], idx[:, 1:], scale))
    return out


def image_data(batch: int, image: int, steps: int = 64, **_: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(batch * 4, 3, image, image, generator=g),
            torch.randint(0, 10, (batch * 4,), generator=g),
        )
        for _ in range(steps)
    ]


def text_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    idx, target, scale = batch
    logits = model(idx, scale)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    data: str
    loss: str | None
    dtype: str
    wider: int = 1  # the size's width times this (a longer step of the same model)

    def config(
        self,
        size: str,
        steps: int,
        device: str = "cpu",
        *,
        optimizer: dict | None = None,
        scheduler: dict | None = None,
        **data_args: int,
    ) -> LoadedConfig:
        """The workload as a nandoctor config, built in memory (no file is written);
        AdamW at 1e-4 unless `optimizer` says otherwise, and no scheduler unless given."""
        from nandoctor.setup.load import LoadedConfig
        from nandoctor.setup.schema import Config

        knobs = {**SIZES[size], "width": SIZES[size]["width"] * self.wider}
        config = Config.model_validate(
            {
                "name": f"{self.name} ({size})",
                "model": self.model,
                "model_args": knobs,
                "data": self.data,
                "data_args": {**knobs, "steps": max(steps, 8), **data_args},
                "loss": self.loss,
                "optimizer": optimizer or {"name": "AdamW", "lr": 1e-4},
                "scheduler": scheduler,
                # NB: the CPU's own autocast, as the plain loop next to it runs: the cost of
                # replaying CUDA's lists on a CPU is benchmarks/autocast_policy.py's figure
                "precision": {"dtype": self.dtype, "autocast_policy": "native"},
                "steps": steps,
                "device": device,
            }
        )
        return LoadedConfig(config, Path(__file__).resolve().parent.parent / "benchmarks.yaml")


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "transformer-bf16",
            "benchmarks.workloads:Decoder",
            "benchmarks.workloads:text_data",
            "benchmarks.workloads:text_loss",
            "bfloat16",
        ),
        Workload(
            "transformer-fp16",
            "benchmarks.workloads:Decoder",
            "benchmarks.workloads:text_data",
            "benchmarks.workloads:text_loss",
            "float16",
        ),
        Workload(
            "mlp-fp16",
            "benchmarks.workloads:build_mlp",
            "benchmarks.workloads:mlp_data",
            None,
            "float16",
        ),
        Workload(
            "mlp-bf16",
            "benchmarks.workloads:build_mlp",
            "benchmarks.workloads:mlp_data",
            None,
            "bfloat16",
        ),
        Workload(
            "convnet-bf16",
            "benchmarks.workloads:build_convnet",
            "benchmarks.workloads:image_data",
            None,
            "bfloat16",
        ),
        Workload(
            "transformer-fp32",
            "benchmarks.workloads:Decoder",
            "benchmarks.workloads:text_data",
            "benchmarks.workloads:text_loss",
            "float32",
        ),
        Workload(
            "mlp-fp32",
            "benchmarks.workloads:build_mlp",
            "benchmarks.workloads:mlp_data",
            None,
            "float32",
        ),
        # NB: the MLP twice as wide, 3.2 million parameters: a 20-30 ms float32 step on 2
        # cores, where the whole-process figures are taken (a step of a few ms is mostly
        # the start-up's and Python's; one of seconds hides every per-step cost)
        Workload(
            "mlp-wide-fp32",
            "benchmarks.workloads:build_mlp",
            "benchmarks.workloads:mlp_data",
            None,
            "float32",
            wider=2,
        ),
        Workload(
            "convnet-fp32",
            "benchmarks.workloads:build_convnet",
            "benchmarks.workloads:image_data",
            None,
            "float32",
        ),
    )
}
