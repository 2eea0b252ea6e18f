"""An epsilon lost to the dtype, found wherever it is added: a number, a buffer, a
clamp's or a maximum's floor, a fill, a `where`; in the forward, the loss or the
optimizer; on small models and on a transformers Llama. When the zeros that made the
NaN are the ones the epsilon was to guard, eps-underflow ranks above the division (or
log) it broke, and its fix names the epsilon, its line and a value the dtype holds.

Each model is written the way people write it; the failing line is found by its marker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import nandoctor
from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.setup.load import load_config
from tests.helpers.project import base_config

VERIFY = DiagnoseOptions(verify_budget=120.0)
NO_VERIFY = DiagnoseOptions(verify=False)

NORMS_PY = """
import torch
import torch.nn.functional as F
from torch import nn

DIM = 16


class Norm(nn.Module):
    '''Scales rows to unit size, guarded by an epsilon given in one of the ways people do.'''

    def __init__(self, how, eps=1e-8):
        super().__init__()
        self.how, self.eps = how, eps
        self.register_buffer("eps_buf", torch.tensor(eps))

    def forward(self, x):
        if self.how == "number":
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps)  # marker:number
        if self.how == "buffer":
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + self.eps_buf)  # marker:buffer
        n = x.norm(dim=-1, keepdim=True)
        if self.how == "clamp_min":
            return x / n.clamp_min(self.eps)  # marker:clamp_min
        if self.how == "maximum":
            return x / torch.maximum(n, self.eps_buf)  # marker:maximum
        if self.how == "full_like":
            return x / torch.max(n, torch.full_like(n, self.eps))  # marker:full_like
        if self.how == "where":
            return x / torch.where(n > self.eps, n, self.eps)  # marker:where
        if self.how == "numerator":
            return (x + self.eps) / n  # marker:numerator
        return x


class Net(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.norm = Norm(how)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


def build(how="number", half=False):
    model = Net(how)
    return model.half() if half else model


def data(batches=6, zero_from=3, half=False):
    '''From batch `zero_from` on, the first row is all zeros (a padded, empty example).'''
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        x = torch.randn(8, DIM, generator=g)
        if i >= zero_from:
            x[0] = 0.0
        y = torch.randint(0, 4, (8,), generator=g)
        out.append((x.half() if half else x, y))
    return out


def half_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def relative_loss(model, batch):
    '''A relative error, its denominator guarded by an epsilon: |pred - t| / (|t| + eps).'''
    x, _ = batch
    pred, target = model(x)[:, 0], x[:, 1]
    return ((pred - target).abs() / (target.abs() + 1e-8)).mean()  # marker:loss


class Bag(nn.Module):
    '''Token embeddings averaged: the rows of tokens a batch never uses get 0 gradients.'''

    def __init__(self, vocab=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def build_bag():
    return Bag().half()


def bag_data(batches=4):
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randint(0, 16, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g))
        for _ in range(batches)
    ]
"""


def line_of(marker: str, text: str = NORMS_PY) -> int:
    for number, line in enumerate(text.splitlines(), start=1):
        if re.search(rf"# marker:{marker}\b", line):
            return number
    raise AssertionError(marker)


def report_of(project, how: str, *, half: bool, options=NO_VERIFY, **overrides):
    """float16: autocast and a GradScaler on float32 weights, or a `model.half()` run
    (float16 weights and data, no autocast, no scaler)."""
    config = base_config(
        model="train.py:build",
        model_args={"how": how, "half": half},
        data="train.py:data",
        data_args={"half": half},
        optimizer={"name": "SGD", "lr": 0.1},
        precision={"dtype": "float32"} if half else {"dtype": "float16"},
        **({"loss": "train.py:half_loss"} if half else {}),
    )
    config.update(overrides)
    return diagnose(load_config(project(config, NORMS_PY)), options)


# (how, half, words of the evidence): the epsilon as the user gave it, and its fate
PLACEMENTS = [
    ("number", False, "aten.add.Tensor at {line} added 1e-08, which is 0 in float16"),
    (
        "buffer",
        False,
        "aten.add.Tensor at {line} added the buffer norm.eps_buf (1e-08), which is 0 in float16",
    ),
    ("clamp_min", True, "aten.clamp_min.default at {line} floored at 1e-08, which is 0 in float16"),
    (
        "maximum",
        True,
        "aten.maximum.default at {line} floored at the buffer norm.eps_buf, which holds 0 in "
        "float16",
    ),
    (
        "full_like",
        True,
        "aten.maximum.default at {line} floored at a full_like of 1e-08, which is 0 in float16",
    ),
    ("where", True, "aten.where.self at {line} fell back to 1e-08, which is 0 in float16"),
]


@pytest.mark.parametrize(("how", "half", "words"), PLACEMENTS, ids=[p[0] for p in PLACEMENTS])
def test_an_epsilon_lost_in_the_forward_is_found_however_it_is_given(project, how, half, words):
    report = report_of(project, how, half=half)
    first = report.first_nonfinite
    source = f"{first.source.rsplit(':', 1)[0]}:{line_of(how)}"
    assert (first.step, first.phase, first.op, first.source) == (
        3,
        "forward",
        "aten.div.Tensor",
        source,
    )
    top, *rest = report.causes
    assert top.id == "eps-underflow", [c.id for c in report.causes]
    assert top.evidence[0].startswith(words.format(line=source)), top.evidence[0]
    assert top.evidence[0].endswith("so aten.div.Tensor still met 1 exact zero")
    assert top.fix.startswith(f"Use an epsilon float16 can hold at {source}: ")
    assert "use 1e-5 or more for float16" in top.fix
    assert "division-by-zero" in [c.id for c in rest]  # the division it broke, ranked below


@pytest.mark.parametrize("how", ["buffer", "full_like", "maximum"])
def test_the_fix_of_an_epsilon_given_as_a_tensor_is_replayed(project, how):
    """The what-if raises a tensor epsilon as it raises a number (a float32 buffer in a
    float16 sum, a fill); a float16 model's buffer holds 0 already, so the op is guarded."""
    half = how != "buffer"
    report = report_of(project, how, half=half, options=VERIFY)
    top = report.causes[0]
    assert (top.id, top.verified) == ("eps-underflow", True), top.verification
    raised = "with epsilons raised to what the dtype can hold"
    if how == "maximum":
        assert top.verification.startswith(f"with the div at train.py:{line_of(how)} guarded")
    else:
        assert top.verification.startswith(raised)


def test_an_epsilon_on_the_numerator_does_not_guard_the_denominator(project):
    """`(x + eps) / n`: the zeros were the denominator's; no epsilon was meant for them."""
    report = report_of(project, "numerator", half=True)
    ids = [c.id for c in report.causes]
    assert ids[0] == "division-by-zero" and "eps-underflow" not in ids


def test_an_epsilon_lost_in_the_loss(project):
    report = report_of(project, "plain", half=True, loss="train.py:relative_loss")
    first = report.first_nonfinite
    assert (first.step, first.phase, first.op) == (3, "loss", "aten.div.Tensor")
    top = report.causes[0]
    line = f"train.py:{line_of('loss')}"
    assert top.id == "eps-underflow"
    assert top.evidence[0].startswith(f"aten.add.Tensor at {first.source.rsplit(':', 1)[0]}:")
    assert f"{line} added 1e-08, which is 0 in float16" in top.evidence[0]
    assert "use 1e-5 or more for float16" in top.fix


def test_adam_eps_in_a_half_model_is_named_with_a_value_float16_holds(project):
    """Adam's default eps=1e-8 beside float16 weights and state: the rows of tokens the
    batch did not use have 0 gradients, 0 state, and an update of 0 / (0 + 0)."""
    config = base_config(
        model="train.py:build_bag",
        data="train.py:bag_data",
        loss="train.py:half_loss",
        optimizer={"name": "Adam", "lr": 1e-3},
    )
    report = diagnose(load_config(project(config, NORMS_PY)), VERIFY)
    first = report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (0, "optimizer", "param:emb.weight")
    top = report.causes[0]
    assert top.id == "eps-underflow" and top.verified, top.verification
    assert top.evidence[0].startswith(
        "the optimizer's eps=1e-08 is 0 in the float16 parameters' dtype, so "
        f"{first.op} divided by "
    )
    assert top.fix.startswith("Give Adam an eps float16 holds where you build it (`eps=1e-4`")
    assert "eps=1e-08 is 0 in float16" in top.fix


# -- on a transformers Llama, in the user's own loop -----------------------------------------
def tiny_llama(**config: object) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    settings = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        **config,
    }
    llama_config = transformers.LlamaConfig(**settings)
    llama_config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(llama_config)


class RMSNorm(nn.Module):
    """A hand-written RMSNorm in the input's dtype, its epsilon kept as a buffer."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("eps", torch.tensor(eps))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(variance + self.eps)  # marker:rms


def llama_batches(padded_from: int = 2) -> list[tuple[torch.Tensor, ...]]:
    """Token batches; from `padded_from` on, the first sequence ends in padding (token 0,
    whose embedding row `padding_idx` keeps at zero)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        ids = torch.randint(1, 64, (4, 12), generator=g)
        mask = torch.ones_like(ids)
        if i >= padded_from:
            ids[0, 9:], mask[0, 9:] = 0, 0
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


def guarded_run(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list):
    def train_step(batch):
        ids, mask, labels = batch
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        return loss

    guard = nandoctor.Guard(model, optimizer)
    with pytest.raises(nandoctor.NonFiniteError) as caught:
        for batch in batches:
            guard.step(train_step, batch)
    return caught.value.report


def test_a_llama_whose_own_rmsnorm_keeps_its_eps_in_a_float16_buffer():
    """Its norms swapped for the user's RMSNorm (rms_norm_eps=1e-8) and the model made
    float16: the buffer holds 0, the padding's zero rows meet rsqrt(0 + 0) = inf."""
    model = tiny_llama(rms_norm_eps=1e-8, pad_token_id=0, initializer_range=0.5)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child).__name__ == "LlamaRMSNorm":
                setattr(module, name, RMSNorm(32, model.config.rms_norm_eps))
    model = model.half()
    report = guarded_run(model, torch.optim.SGD(model.parameters(), lr=1e-2), llama_batches())
    first = report.first_nonfinite
    assert (first.step, first.phase, first.op) == (2, "forward", "aten.rsqrt.default")
    assert first.module == "model.layers.0.input_layernorm"
    top = report.causes[0]
    line = f"tests/causes/test_eps_underflow.py:{line_of('rms', Path(__file__).read_text())}"
    assert top.id == "eps-underflow", [c.id for c in report.causes]
    assert top.evidence[0].startswith(
        f"aten.add.Tensor at {line} added the buffer model.layers.0.input_layernorm.eps, "
        "which holds 0 in float16"
    )
    assert top.fix.startswith(f"Use an epsilon float16 can hold at {line}: ")


def test_a_half_llama_with_adams_default_eps():
    model = tiny_llama().half()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    report = guarded_run(model, optimizer, llama_batches(padded_from=99))
    first = report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (
        0,
        "optimizer",
        "param:model.embed_tokens.weight",
    )
    top = report.causes[0]
    assert top.id == "eps-underflow"
    assert top.evidence[0].startswith("the optimizer's eps=1e-08 is 0 in the float16 parameters'")
    assert "(`eps=1e-4` or more)" in top.fix
