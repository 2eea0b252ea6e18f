"""fp16-without-grad-scaler on the loops people write: the AMP recipe with and without its
scaler, a notebook, Accelerate, Lightning, DeepSpeed, a hand-scaled loss, evaluation."""

from __future__ import annotations

import json

import pytest

from nandoctor.lint import LintConfig, Severity, lint_paths, lint_text

ID = "fp16-without-grad-scaler"


def found(text: str) -> list[int]:
    """The lines this check reports."""
    outcome = lint_text(text)
    assert not outcome.skipped
    return [f.line for f in outcome.findings if f.id == ID]


# PyTorch's AMP recipe, as a script that forgot the scaler (or never knew it).
AMP_LOOP = """\
import torch
import torch.nn.functional as F

model = Net().cuda()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
for epoch in range(epochs):
    for x, y in loader:
        x, y = x.cuda(), y.cuda()
        with torch.cuda.amp.autocast():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
"""
AMP_LOOP_SCALED = (
    AMP_LOOP.replace("for epoch", "scaler = torch.cuda.amp.GradScaler()\nfor epoch")
    .replace("loss.backward()", "scaler.scale(loss).backward()")
    .replace("opt.step()", "scaler.step(opt)\n        scaler.update()")
)


def test_the_amp_loop_without_a_scaler_is_flagged_at_its_autocast():
    assert found(AMP_LOOP) == [9]
    (finding,) = [f for f in lint_text(AMP_LOOP).findings if f.id == ID]
    assert finding.severity is Severity.WARNING
    assert finding.code.strip() == "with torch.cuda.amp.autocast():"
    assert (finding.column, finding.end_column) == (14, 39)  # the autocast call itself


def test_the_message_names_the_backward_the_remedy_and_the_numbers():
    (finding,) = [f for f in lint_text(AMP_LOOP).findings if f.id == ID]
    message = finding.message
    assert message.startswith("Add a GradScaler (`scaler.scale(loss).backward()`")
    assert "`torch.bfloat16`" in message
    assert "`loss.backward()` (from line 11)" in message
    assert "CUDA's default" in message
    for number in ("6e-8", "65504", "NaN"):
        assert number in message


def test_the_amp_loop_with_its_scaler_is_not():
    assert "scaler.step(opt)" in AMP_LOOP_SCALED
    assert found(AMP_LOOP_SCALED) == []


@pytest.mark.parametrize(
    "autocast",
    [
        'torch.autocast("cuda", dtype=torch.float16)',
        'torch.autocast("cuda", torch.half)',
        'torch.amp.autocast(device_type="cuda", dtype=torch.float16)',
        'torch.autocast("cuda")',
        "torch.autocast(device_type=device.type)",
        "torch.cuda.amp.autocast(enabled=args.amp)",
        'torch.autocast("cpu", dtype=torch.float16)',
    ],
)
def test_float16_autocast_in_any_spelling(autocast):
    assert found(AMP_LOOP.replace("torch.cuda.amp.autocast()", autocast)) == [9]


@pytest.mark.parametrize(
    "autocast",
    [
        'torch.autocast("cuda", dtype=torch.bfloat16)',
        "torch.cuda.amp.autocast(dtype=torch.bfloat16)",
        'torch.autocast("cpu")',
        "torch.cpu.amp.autocast()",
        'torch.autocast("cuda", dtype=amp_dtype)',
        'torch.autocast("cuda", dtype=torch.float16, enabled=False)',
        "torch.cuda.amp.autocast(enabled=False)",
    ],
)
def test_bfloat16_the_cpu_an_unknown_dtype_or_disabled_autocast_are_not(autocast):
    assert found(AMP_LOOP.replace("torch.cuda.amp.autocast()", autocast)) == []


def test_aliases_of_autocast_and_of_float16():
    text = """\
import torch
from torch import autocast, float16 as f16
HALF = torch.half
with autocast("cuda", dtype=f16):
    loss = model(x).sum()
loss.backward()
opt.step()
with autocast("cuda", dtype=HALF):
    loss = model(x).sum()
loss.backward()
opt.step()
"""
    assert found(text) == [4, 8]


NOTEBOOK_CELL = """\
model = model.to("cuda")
optimizer = torch.optim.Adam(model.parameters(), 1e-3)
for batch in train_dl:
    optimizer.zero_grad()
    with torch.autocast('cuda'):
        out = model(batch['x'].cuda())
        loss = nn.MSELoss()(out, batch['y'].cuda())
    loss.backward()
    optimizer.step()
"""


def test_a_notebook_style_snippet_without_imports():
    assert found(NOTEBOOK_CELL) == [5]


def test_in_a_notebook_the_finding_is_in_its_cell_and_names_the_backwards_line(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    cells = ["import torch\nfrom torch import nn", NOTEBOOK_CELL]
    nb = {
        "cells": [
            {"cell_type": "code", "metadata": {}, "source": c.splitlines(keepends=True)}
            for c in cells
        ],
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tmp_path / "train.ipynb").write_text(json.dumps(nb))
    (finding,) = lint_paths(["train.ipynb"], LintConfig()).findings
    assert (finding.id, finding.cell, finding.line) == (ID, 2, 5)
    assert "`loss.backward()` (from line 8)" in finding.message


ACCELERATE = """\
import torch
from accelerate import Accelerator

accelerator = Accelerator()
model, opt, loader = accelerator.prepare(model, opt, loader)
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
"""
LIGHTNING = """\
import torch
import lightning as L


class LitModel(L.LightningModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.autocast("cuda", dtype=torch.float16):
            return self.loss_fn(self(x), y)

    def backward(self, loss):
        loss.backward()  # Lightning passes the loss already scaled
"""
MANUAL_BACKWARD = """\
import torch


class GAN(Module):
    def training_step(self, batch):
        opt_g, opt_d = self.optimizers()
        with torch.autocast("cuda"):
            g_loss = self.generator_loss(batch)
        self.manual_backward(g_loss)
        opt_g.step()
"""
DEEPSPEED = """\
import torch
import deepspeed

engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters())
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = engine(x, y)
    engine.backward(loss)
    engine.step()
"""
PASSED_IN_SCALER = """\
import torch


def train_one_epoch(model, opt, loader, scaler):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def finetune(model, opt, x, y):
    loss = model(x, y)  # float32
    loss.backward()
    opt.step()
"""
TIMM = """\
import torch
from timm.utils import NativeScaler

loss_scaler = NativeScaler()
for x, y in loader:
    with torch.cuda.amp.autocast():
        loss = criterion(model(x), y)
    loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())
    if not amp:
        loss.backward()
"""
EVAL_ONLY = """\
import torch
import torch.nn.functional as F


def train(model, opt, loader):
    for x, y in loader:
        loss = F.cross_entropy(model(x), y)  # float32 training
        loss.backward()
        opt.step()
        opt.zero_grad()
    evaluate(model, val_loader)
    validate(model, val_loader)


def evaluate(model, loader):
    model.eval()
    with torch.no_grad():
        with torch.autocast("cuda", dtype=torch.float16):
            return sum(F.cross_entropy(model(x), y).item() for x, y in loader)


@torch.inference_mode()
def predict(model, x):
    with torch.cuda.amp.autocast():
        return model(x)


def validate(model, loader):
    with torch.autocast("cuda", dtype=torch.float16):  # no backward here, and no no_grad
        return [model(x) for x, _ in loader]
"""


@pytest.mark.parametrize(
    "text",
    [ACCELERATE, LIGHTNING, MANUAL_BACKWARD, DEEPSPEED, PASSED_IN_SCALER, TIMM, EVAL_ONLY],
    ids=["accelerate", "lightning", "manual_backward", "deepspeed", "passed-in-scaler", "timm",
         "eval-only"],
)  # fmt: skip
def test_libraries_that_scale_a_scaler_anywhere_and_evaluation_are_not_flagged(text):
    assert found(text) == []


def test_the_float16_scaler_free_loop_is_flagged_beside_a_float32_one():
    """The scaler-free variant of PASSED_IN_SCALER: the float16 region, once; not the
    float32 fine-tune's backward."""
    text = PASSED_IN_SCALER.replace("scaler.scale(loss).backward()", "loss.backward()")
    text = text.replace("scaler.step(opt)", "opt.step()").replace("        scaler.update()\n", "")
    text = text.replace(", scaler)", ")")
    assert found(text) == [6]


@pytest.mark.parametrize(
    ("backward", "flagged"),
    [
        ("(loss * loss_scale).backward()", False),
        ("(loss * 1024).backward()", False),
        ("(2**16 * loss).backward()", False),
        ("scaled_loss.backward()", False),
        ("loss = loss * self.static_scale\n    loss.backward()", False),
        ("loss *= 128.0\n    loss.backward()", False),
        ("(loss / accum_steps).backward()", True),  # gradient accumulation, no scaling
        ("(loss * 0.5).backward()", True),  # a weight below 1
        ("loss.backward(retain_graph=True)", True),
        ("torch.autograd.backward(loss)", True),
    ],
)
def test_a_loss_scaled_by_hand_is_trusted(backward, flagged):
    text = f"""\
import torch
def step(model, opt, x):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x)
    {backward}
    opt.step()
"""
    assert found(text) == ([3] if flagged else [])


def test_an_autocast_context_built_once_is_judged_where_it_is_entered():
    text = """\
import torch
from contextlib import nullcontext
ctx = nullcontext() if device == "cpu" else torch.amp.autocast("cuda", dtype=torch.float16)
eval_ctx = torch.autocast("cuda", dtype=torch.float16)


def pretrain_head(head, opt, features, y):
    head_loss = (head(features) - y).pow(2).mean()  # float32
    head_loss.backward()
    opt.step()


def train(model, opt, loader):
    for x, y in loader:
        with ctx:
            loss = model(x, y)
        loss.backward()
        opt.step()


@torch.no_grad()
def estimate_loss(model, loader):
    with eval_ctx:
        return [model(x, y) for x, y in loader]
"""
    assert found(text) == [3]
    (finding,) = [f for f in lint_text(text).findings if f.id == ID]
    assert "`loss.backward()` (from line 17)" in finding.message  # after `with ctx:`


def test_one_finding_per_region_however_many_backwards():
    text = """\
import torch
for real, z in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        d_loss = disc(real).mean() - disc(gen(z).detach()).mean()
        g_loss = -disc(gen(z)).mean()
    d_loss.backward()
    d_opt.step()
    g_loss.backward()
    g_opt.step()
"""
    assert found(text) == [3]


def test_a_file_without_backward_is_not_flagged():
    """The autocast of a model file: its training loop lives elsewhere."""
    text = """\
import torch
class Net(torch.nn.Module):
    @torch.autocast("cuda")
    def forward(self, x):
        return self.fc(x)
"""
    assert found(text) == []


def test_the_finding_can_be_suppressed_on_the_autocast_line():
    text = AMP_LOOP.replace(
        "with torch.cuda.amp.autocast():",
        "with torch.cuda.amp.autocast():  # nandoctor: ignore[fp16-without-grad-scaler]",
    )
    assert found(text) == []


# A model test (diffusers', transformers' style): it backpropagates under float16 to check
# that every parameter gets a gradient, and never updates a weight.
GRADIENT_TEST = """\
import unittest

import torch


class UNetTests(unittest.TestCase):
    def test_mixed_precision_backward(self):
        model = self.get_model()
        with torch.autocast(device_type="cuda", dtype=torch.float16):
            loss = model(**self.inputs).sample.mean()
        loss.backward()
        for name, param in model.named_parameters():
            self.assertIsNotNone(param.grad, name)
"""


def test_a_backward_that_no_optimizer_step_follows_trains_nothing():
    assert found(GRADIENT_TEST) == []


def test_a_script_that_only_inspects_gradients_is_not_flagged():
    text = """\
import torch
with torch.autocast(device_type="cuda", dtype=torch.float16):
    loss = model(x).sum()
    loss.backward()
print("Gradient type", model.fc1.weight.grad.dtype)
"""
    assert found(text) == []


def test_a_step_in_another_test_of_the_file_does_not_make_the_gradient_test_training():
    text = (
        GRADIENT_TEST
        + """
    def test_training(self):  # float32
        model = self.get_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loss = model(**self.inputs).sample.mean()
        loss.backward()
        optimizer.step()
"""
    )
    assert found(text) == []


def test_schedulers_profilers_and_ema_do_not_step_an_optimizer():
    text = GRADIENT_TEST.replace(
        "        for name, param",
        "        lr_scheduler.step()\n        prof.step()\n"
        "        ema_model.step(model.parameters())\n"
        "        noise_scheduler.step(noise_pred, t, sample)\n        for name, param",
    )
    assert found(text) == []


@pytest.mark.parametrize(
    "step",
    [
        "optimizer.step()",
        "self.optimizer.step()",
        "optimizers[0].step()",
        "g_optim.step()",
        "optimizer.step(closure)",
        "opt.step(closure=closure)",
        "trainer.step()",
    ],
)
def test_an_optimizer_step_of_any_name_makes_it_training(step):
    text = f"""\
import torch
def train(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x)
    loss.backward()
    {step}
"""
    assert found(text) == [3]


def test_a_step_in_a_helper_the_training_function_calls_counts():
    text = """\
import torch


def apply_update(opt, model):
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def train(model, opt, loader):
    for x, y in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x, y)
        loss.backward()
        apply_update(opt, model)
"""
    assert found(text) == [12]


def test_a_step_in_the_caller_or_a_sibling_method_it_calls_counts():
    text = """\
import torch


class Trainer:
    def fit(self, loader):
        for batch in loader:
            self.backprop(batch)
            self.update()

    def backprop(self, batch):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = self.model(batch)
        loss.backward()

    def update(self):
        self.opt.step()
"""
    assert found(text) == [11]


def test_a_closure_stepped_by_its_optimizer_counts():
    text = """\
import torch
def train(model, opt, x):
    def closure():
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x)
        loss.backward()
        return loss
    opt.step(closure)
"""
    assert found(text) == [5]


def test_an_autocast_forward_is_training_when_the_file_steps_anywhere():
    """The backward of a decorated `forward` is elsewhere: any step of the file counts."""
    text = """\
import torch
class Net(torch.nn.Module):
    @torch.autocast("cuda")
    def forward(self, x):
        return self.fc(x)
def train(model, opt, x):
    model(x).sum().backward()
    opt.step()
"""
    assert found(text) == [3]
    assert found(text.replace("    opt.step()\n", "")) == []


DISABLED_SCALER = """\
import torch

scaler = torch.cuda.amp.GradScaler(enabled=False)
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


@pytest.mark.parametrize(
    "scaler",
    [
        "torch.cuda.amp.GradScaler(enabled=False)",
        'torch.amp.GradScaler("cuda", enabled=False)',
        "torch.cuda.amp.GradScaler(2.0**16, 2.0, 0.5, 2000, False)",
    ],
)
def test_a_disabled_scaler_is_no_scaler(scaler):
    """`enabled=False` makes `scale(loss)` the loss itself: float16 gradients unscaled."""
    assert found(DISABLED_SCALER.replace("torch.cuda.amp.GradScaler(enabled=False)", scaler)) == [5]


def test_the_message_asks_to_enable_the_disabled_scaler():
    (finding,) = [f for f in lint_text(DISABLED_SCALER).findings if f.id == ID]
    assert finding.message.startswith(
        "Enable the GradScaler (`torch.cuda.amp.GradScaler(enabled=False)` (from line 3)"
    )
    assert "`scaler.scale(loss).backward()` (from line 7) runs unscaled" in finding.message


def test_a_disabled_scaler_beside_a_plain_backward_is_flagged():
    text = DISABLED_SCALER.replace("scaler.scale(loss).backward()", "loss.backward()")
    assert found(text.replace("scaler.step(opt)", "opt.step()")) == [5]


@pytest.mark.parametrize(
    "scaler",
    [
        "torch.cuda.amp.GradScaler(enabled=use_amp)",
        'torch.amp.GradScaler("cuda", enabled=(dtype == "float16"))',
        "torch.cuda.amp.GradScaler(enabled=True)",
        "torch.cuda.amp.GradScaler()",
        # an off switch for the CPU only: the CUDA scaler may be on
        'torch.amp.GradScaler("cuda", enabled=amp) if cuda '
        "else torch.amp.GradScaler(enabled=False)",
    ],
)
def test_a_scaler_that_may_be_enabled_still_counts(scaler):
    assert found(DISABLED_SCALER.replace("torch.cuda.amp.GradScaler(enabled=False)", scaler)) == []


def test_another_librarys_scaler_beside_a_disabled_one_still_counts():
    """timm's `NativeScaler` scales inside the library, whatever GradScaler sits beside it."""
    timm = "from timm.utils import NativeScaler\nloss_scaler = NativeScaler()\n"
    assert found(DISABLED_SCALER.replace("import torch\n", f"import torch\n{timm}")) == []


# llm.c's train_gpt2.py (its `__main__` block, dedented): the dtype is a flag, float16 one of
# its values, and no scaler.
LLMC = """\
import torch
from contextlib import nullcontext

dtype = args.dtype
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
ctx = torch.amp.autocast(device_type="cuda", dtype=ptdtype) if device == "cuda" else nullcontext()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
for i in range(args.num_iterations):
    with ctx:
        logits, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
"""


def test_a_dtype_looked_up_in_a_dict_that_offers_float16_is_flagged():
    assert found(LLMC) == [6]


def test_the_message_says_it_applies_when_float16_is_picked():
    (finding,) = [f for f in lint_text(LLMC).findings if f.id == ID]
    assert "under autocast to `ptdtype` (whenever it picks float16)" in finding.message
    assert "`loss.backward()` (from line 12)" in finding.message


def test_nanogpt_scales_exactly_when_it_picks_float16():
    """nanoGPT's train.py: the same lookup, and a scaler enabled for float16."""
    text = LLMC.replace(
        "optimizer = torch",
        "scaler = torch.cuda.amp.GradScaler(enabled=(dtype == 'float16'))\noptimizer = torch",
    )
    text = text.replace("loss.backward()", "scaler.scale(loss).backward()")
    assert found(text.replace("optimizer.step()", "scaler.step(optimizer)")) == []


@pytest.mark.parametrize(
    ("dtype", "flagged"),
    [
        ("torch.float16 if args.fp16 else torch.bfloat16", True),
        ("torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.half", True),
        ("{'float32': torch.float32, 'bfloat16': torch.bfloat16}[dtype]", False),
        ("torch.bfloat16 if args.bf16 else torch.float32", False),
    ],
)
def test_a_dtype_chosen_by_a_conditional_is_flagged_when_float16_is_a_choice(dtype, flagged):
    text = LLMC.replace(
        "{'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]",
        dtype,
    )
    assert found(text) == ([6] if flagged else [])


def test_an_unknown_dtype_variable_is_still_not_guessed():
    text = LLMC.replace("ptdtype = {", "unused = {")
    assert found(text) == []


# timm's train.py builds its autocast as a factory and enters it with `with amp_autocast():`.
PARTIAL = """\
import torch
from functools import partial


def train_one_epoch(model, loader, optimizer, amp_autocast):
    for x, y in loader:
        with amp_autocast():
            loss = model(x, y)
        loss.backward()
        optimizer.step()


def main(args):
    amp_autocast = partial(torch.autocast, device_type="cuda", dtype=torch.float16)
    train_one_epoch(model, loader, optimizer, amp_autocast)
    with amp_autocast():
        loss = model(x, y)
    loss.backward()
    optimizer.step()
"""


def test_a_partial_of_autocast_is_judged_where_it_is_entered():
    """Once, on the factory; entered first in the loop it is handed to (same name)."""
    assert found(PARTIAL) == [14]
    (finding,) = [f for f in lint_text(PARTIAL).findings if f.id == ID]
    assert "`loss.backward()` (from line 9)" in finding.message


@pytest.mark.parametrize(
    ("factory", "flagged"),
    [
        ('partial(torch.autocast, device_type="cuda")', True),  # CUDA's default: float16
        ('partial(torch.autocast, "cuda", torch.half)', True),
        ('partial(torch.autocast, device_type="cuda", dtype=torch.bfloat16)', False),
        ('partial(torch.autocast, device_type="cuda", dtype=torch.float16, enabled=False)', False),
        ('partial(torch.autocast, device_type="cpu")', False),
        ("partial(print, dtype=torch.float16)", False),
    ],
)
def test_a_partial_of_autocast_in_any_spelling(factory, flagged):
    text = PARTIAL.replace(
        'partial(torch.autocast, device_type="cuda", dtype=torch.float16)', factory
    )
    assert found(text) == ([14] if flagged else [])


def test_timms_factory_with_its_scaler_for_float16_is_not_flagged():
    choice = "    amp_dtype = torch.bfloat16 if args.amp_dtype == 'bfloat16' else torch.float16\n"
    scaler = "    loss_scaler = NativeScaler() if amp_dtype == torch.float16 else None\n"
    text = PARTIAL.replace(
        "    amp_autocast = partial(", f"{choice}{scaler}    amp_autocast = partial("
    )
    text = text.replace("dtype=torch.float16)", "dtype=amp_dtype)")
    timm = text.replace("from functools", "from timm.utils import NativeScaler\nfrom functools")
    assert found(timm) == []
    assert found(text.replace(scaler, "")) == [15]
