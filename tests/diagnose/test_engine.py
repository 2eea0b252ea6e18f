"""`diagnose` end to end on real models: the first bad step and its phase, determinism,
healthy runs stay healthy, benign scaler skips are events."""

from __future__ import annotations

import pytest
import torch

from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.setup.load import load_config
from tests.helpers.paths import CONFIGS
from tests.helpers.project import base_config

NO_VERIFY = DiagnoseOptions(verify=False)

LOSSES = """
import torch
import torch.nn.functional as F


def sqrt_of_zero(model, batch):
    x, y = batch
    out = model(x)
    # finite forward (sqrt(0) = 0) but an infinite derivative in backward
    return F.cross_entropy(out, y) + torch.sqrt((out * 0).pow(2).sum())
"""


def run(project, **overrides):
    return diagnose(load_config(project(base_config(**overrides))), NO_VERIFY)


def test_seed_example_fails_after_training_a_while_in_the_loss():
    loaded = load_config(CONFIGS / "seed-fp16-nan.yaml")
    report = diagnose(loaded, NO_VERIFY)
    assert report.status == "nonfinite"
    assert report.first_nonfinite.step > loaded.config.data_args["batches"]  # past epoch 1
    assert report.first_nonfinite.phase == "loss"
    assert report.steps_completed == report.first_nonfinite.step
    assert report.telemetry.step[-1] == report.first_nonfinite.step


def test_seed_example_is_deterministic():
    a = diagnose(load_config(CONFIGS / "seed-fp16-nan.yaml"), NO_VERIFY)
    b = diagnose(load_config(CONFIGS / "seed-fp16-nan.yaml"), NO_VERIFY)
    assert without_timing(a) == without_timing(b)
    assert a.first_nonfinite.reproduced == "exact"


def without_timing(report) -> dict:
    return {k: v for k, v in report.to_dict().items() if k != "timing"}


def test_fixed_example_is_healthy_for_all_its_steps():
    loaded = load_config(CONFIGS / "seed-fixed.yaml")
    report = diagnose(loaded)
    assert report.status == "healthy" and report.first_nonfinite is None
    assert report.steps_completed == loaded.config.steps


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_nan_in_the_batch_is_caught_in_input_at_its_exact_step(project, dtype):
    # 4 batches an epoch: batch 2 holds a NaN, first met at step 2
    report = run(project, data_args={"nan_at": 2}, precision={"dtype": dtype})
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (2, "input")
    assert report.steps_completed == 2


MASKED = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def regression(batches=8, log_zero_at=None):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True)
        y[::5] = float("nan")  # labels missing, stored as NaN
        out.append((x, y, torch.tensor(float(i == log_zero_at))))
    return out


def masked_mse(model, batch):
    x, y, log_zero = batch
    known = ~torch.isnan(y)
    return ((model(x) - y)[known] ** 2).mean() - torch.log(1 - log_zero)
"""


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_labels_missing_as_nan_and_masked_in_the_loss_are_a_healthy_run(project, tmp_path, dtype):
    (tmp_path / "masked.py").write_text(MASKED)
    config = {"model": "masked.py:build_model", "data": "masked.py:regression"}
    report = run(project, **config, loss="masked.py:masked_mse", precision={"dtype": dtype})
    assert report.status == "healthy" and report.first_nonfinite is None


def test_skipping_batches_is_no_verified_fix_when_it_skips_most_of_them(project, tmp_path):
    """Every batch holds a label missing as NaN, and `torch.where` lets it reach the
    backward (0 * NaN): skipping the batches that hold NaN trained on none of them, and
    was reported verified."""
    where = "return torch.where(known, (model(x) - y) ** 2, 0).sum() / known.sum()"
    (tmp_path / "masked.py").write_text(
        MASKED + f"\n\ndef where_mse(model, batch):\n"
        f"    x, y, _ = batch\n    known = ~torch.isnan(y)\n"
        f"    {where}\n"
    )
    config = {"model": "masked.py:build_model", "data": "masked.py:regression"}
    path = project(base_config(**config, loss="masked.py:where_mse", steps=6))
    report = diagnose(load_config(path))  # NB: with the fixes replayed
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (0, "input")
    skip = next(c for c in report.causes if c.id == "nonfinite-input")
    assert skip.verified is not True
    assert "skipped more batches than it trained on" in skip.verification
    # the loss was finite: the NaN labels reached only the gradients, through the where
    assert "the loss of step 0 was finite" in skip.evidence[1]
    assert skip.fix.startswith("Mask missing values by indexing")


@pytest.mark.parametrize("accum", [1, 2])  # 2: batch 3 is step 1's second micro-batch
def test_a_failure_beside_masked_labels_is_found_at_its_own_step_and_op(project, tmp_path, accum):
    (tmp_path / "masked.py").write_text(MASKED)
    config = {"model": "masked.py:build_model", "data": "masked.py:regression"}
    report = run(
        project,
        **config,
        loss="masked.py:masked_mse",
        data_args={"log_zero_at": 3},
        grad_accum_steps=accum,
        steps=8 // accum,
    )
    first = report.first_nonfinite
    assert (first.step, first.phase, first.op) == (3 // accum, "loss", "aten.log.default")
    assert report.causes[0].id == "log-of-zero"
    assert [(t.phase, t.op) for t in report.transients] == [("input", None)]  # the labels' NaN


PADDED = """
import torch
import torch.nn.functional as F
from torch import nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens, mask):
        x = self.embed(tokens)
        return self.head(self.attn(x, x, x, key_padding_mask=mask)[0]).mean(1)


def build_model():
    torch.manual_seed(0)
    return Tagger()


def posts(batches=6, empty_at=None, corrupt_at=None):
    # the collate function's additive mask: 0 for a token, -inf for padding
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        tokens = torch.randint(1, 50, (8, 10), generator=g)
        lengths = torch.randint(3, 11, (8,), generator=g)
        lengths[2] = 0 if i == empty_at else lengths[2]  # a post emptied by the cleaning
        mask = torch.zeros(8, 10).masked_fill(torch.arange(10) >= lengths[:, None], -torch.inf)
        if i == corrupt_at:
            mask[4, 0] = float("nan")  # not a mask's value: the data is broken
        out.append({"tokens": tokens, "mask": mask, "y": torch.randint(0, 3, (8,), generator=g)})
    return out


def loss(model, batch):
    return F.cross_entropy(model(batch["tokens"], batch["mask"]), batch["y"])
"""


def padded_run(project, tmp_path, **data_args):
    (tmp_path / "padded.py").write_text(PADDED)
    config = {"model": "padded.py:build_model", "data": "padded.py:posts", "loss": "padded.py:loss"}
    return run(project, **config, data_args=data_args, optimizer={"name": "AdamW", "lr": 1e-3})


def test_an_additive_padding_mask_in_the_batch_is_a_healthy_run(project, tmp_path):
    # its -inf are summed out by the softmax: the batch is non-finite every step, by design
    assert padded_run(project, tmp_path).status == "healthy"


def test_a_row_the_batchs_mask_pads_entirely_is_the_softmaxs_nan_not_bad_data(project, tmp_path):
    report = padded_run(project, tmp_path, empty_at=3)
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (3, "forward", "attn")
    assert first.op == "aten._softmax.default"
    assert report.causes[0].id == "fully-masked-softmax"


def test_a_mask_that_holds_a_nan_is_still_bad_data(project, tmp_path):
    report = padded_run(project, tmp_path, corrupt_at=3)
    first = report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (3, "input", "input:mask")
    assert report.causes[0].id == "nonfinite-input"


LOGGED = """
import torch
import torch.nn.functional as F
from torch import nn


def build_model(positive=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))
    if positive:  # then -inf comes out of the first layer (no NaN), and the NaN in the loss
        nn.init.uniform_(model[0].weight, 0.01, 0.1)
    return model


def clicks(batches=6, binary_at=None):
    # log-counts: 0 for one click; a day with at most one click per feature is 0 or -inf
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(batches):
        counts = torch.randint(0, 2, (8, 12), generator=g).float()
        counts = counts if i == binary_at else counts + 1
        out.append((torch.log(counts), torch.randint(0, 3, (8,), generator=g)))
    return out


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)
"""


@pytest.mark.parametrize("positive", [False, True])
def test_a_batch_of_only_zeros_and_minus_inf_multiplied_as_features_is_bad_data(
    project, tmp_path, positive
):
    # it looks like an additive mask, but the first layer multiplies it through
    (tmp_path / "logged.py").write_text(LOGGED)
    config = {
        "model": "logged.py:build_model",
        "data": "logged.py:clicks",
        "loss": "logged.py:loss",
    }
    report = run(project, **config, data_args={"binary_at": 3}, model_args={"positive": positive})
    first = report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (3, "input", "input:0")
    assert report.causes[0].id == "nonfinite-input"


def test_an_inf_in_a_later_epoch_batch_is_caught_at_its_step(project):
    report = run(project, data_args={"batches": 4, "inf_at": 3}, steps=10)
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (3, "input")


def test_benign_scaler_skips_are_events_not_failures(project):
    report = run(project, precision={"dtype": "fp16", "init_scale": 2.0**24}, steps=30)
    assert report.status == "healthy"
    skips = [e for e in report.events if e.kind == "scaler-skip"]
    assert len(skips) >= 3
    assert [e.scale for e in skips] == [2.0**24 / 2**i for i in range(len(skips))]


def test_nan_gradients_every_step_collapse_the_scale(project, tmp_path):
    (tmp_path / "losses.py").write_text(LOSSES)
    report = run(project, loss="losses.py:sqrt_of_zero", precision={"dtype": "fp16"}, steps=40)
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (0, "backward")
    assert "GradScaler skipped" in report.summary


def test_nan_gradients_without_a_scaler_fail_at_once(project, tmp_path):
    (tmp_path / "losses.py").write_text(LOSSES)
    report = run(project, loss="losses.py:sqrt_of_zero")
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (0, "backward")


def test_an_update_that_makes_weights_nan_fails_in_the_optimizer(project):
    # Adam with eps=0 on a weight whose gradient is exactly 0: m / sqrt(v) = 0 / 0
    adam = {"name": "Adam", "lr": 1e-3, "eps": 0.0}
    report = run(project, optimizer=adam, data_args={"zero_feature": True})
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (0, "optimizer")


def test_a_checkpoint_with_a_nan_weight_fails_in_parameters(project, tmp_path):
    from tests.helpers.project import TRAIN_PY

    namespace: dict = {}
    exec(TRAIN_PY, namespace)
    state = namespace["build_model"]().state_dict()
    state["2.bias"][1] = float("nan")
    torch.save({"model": state, "step": 40}, tmp_path / "ckpt.pt")
    report = run(project, checkpoint="ckpt.pt")
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (40, "parameters")
    assert report.steps_completed == 0


def test_a_checkpoint_whose_optimizer_state_holds_nan_is_named_and_zeroing_it_verified(
    project, tmp_path
):
    """Finite weights, one NaN in Adam's exp_avg_sq: the first update writes it into the
    weights. It got no cause; the fix that zeroes what was loaded is verified."""
    from nandoctor.diagnose.engine import DiagnoseOptions
    from tests.helpers.project import TRAIN_PY

    namespace: dict = {}
    exec(TRAIN_PY, namespace)
    model = namespace["build_model"]()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    adam.step()
    adam.state[model[0].weight]["exp_avg_sq"][0, 0] = float("nan")
    saved = {"model": model.state_dict(), "optimizer": adam.state_dict(), "step": 7}
    torch.save(saved, tmp_path / "ckpt.pt")
    config = base_config(checkpoint="ckpt.pt", optimizer={"name": "Adam", "lr": 1e-3})
    report = diagnose(load_config(project(config)), DiagnoseOptions())
    first = report.first_nonfinite
    assert (first.step, first.phase, first.tensor) == (7, "optimizer", "state:0.weight.exp_avg_sq")
    top = report.causes[0]
    assert top.id == "nonfinite-parameters" and "loaded" in top.evidence[0]
    assert top.verified is True, top.verification


def test_an_optimizer_state_from_an_older_torch_with_a_named_group_still_loads(project, tmp_path):
    """Only another algorithm's state is refused: a group that lacks a setting a newer
    torch added, and holds a key of the user's own, is the same optimizer's."""
    from tests.helpers.project import TRAIN_PY

    namespace: dict = {}
    exec(TRAIN_PY, namespace)
    model = namespace["build_model"]()
    state = torch.optim.Adam(model.parameters(), lr=1e-3).state_dict()
    del state["param_groups"][0]["decoupled_weight_decay"]  # newer than the saving torch
    state["param_groups"][0]["name"] = "all weights"  # the user's own key
    torch.save({"model": model.state_dict(), "optimizer": state}, tmp_path / "old.pt")
    report = run(project, checkpoint="old.pt", optimizer={"name": "Adam", "lr": 1e-3})
    assert report.status == "healthy"


def test_steps_continue_from_a_checkpoint_step(project, tmp_path):
    from tests.helpers.project import TRAIN_PY

    namespace: dict = {}
    exec(TRAIN_PY, namespace)
    torch.save({"model": namespace["build_model"]().state_dict(), "step": 100}, tmp_path / "c.pt")
    report = run(project, checkpoint="c.pt", data_args={"nan_at": 1})
    assert (report.first_nonfinite.step, report.steps_completed) == (101, 1)


def test_report_records_the_environment(project):
    report = run(project, precision={"dtype": "bf16"})
    env = report.environment
    assert (env.device, env.dtype, env.grad_scaler) == ("cpu", "bfloat16", False)
    assert env.torch == torch.__version__ and env.threads == torch.get_num_threads()
    assert (env.autocast_policy, env.data_sharding) == ("cuda", None)  # the defaults
    # CUDA's autocast lists were replayed: no note that the CPU's cast fewer ops
    assert not any("CPU autocast" in note for note in report.notes)


LOG_SOFTMAX = """
import torch


def log_of_softmax(model, batch):
    x, y = batch
    out = model(x)  # float16 under autocast
    logits = out * 0 + torch.tensor([0.0, -20.0, -20.0], dtype=out.dtype)  # exp(-20): 0 in float16
    return -torch.log(torch.softmax(logits, -1))[:, 1].mean()
"""


@pytest.mark.parametrize(
    ("policy", "status", "dtype"), [("native", "nonfinite", "float16"), ("cuda", "healthy", None)]
)
def test_the_autocast_policy_decides_the_dtype_of_softmax_and_log(project, policy, status, dtype):
    # CUDA autocast runs softmax and log in float32, where exp(-20) is no underflow; the
    # CPU's own lists leave them in float16, where it is 0 and log(0) is -inf
    path = project(
        base_config(
            loss="losses.py:log_of_softmax",
            precision={"dtype": "float16", "autocast_policy": policy},
            steps=2,
        )
    )
    (path.parent / "losses.py").write_text(LOG_SOFTMAX)
    report = diagnose(load_config(path), NO_VERIFY)
    assert report.status == status and report.environment.autocast_policy == policy
    if dtype is not None:
        first = report.first_nonfinite
        assert (first.step, first.op, first.dtype) == (0, "aten.log.default", dtype)
        assert any("CPU autocast casts fewer ops" in n for n in report.notes)
    else:
        assert not any("CPU autocast casts fewer ops" in n for n in report.notes)


def test_the_cpu_autocast_note_names_the_runs_own_dtype(project):
    precision = {"dtype": "bfloat16", "autocast_policy": "native"}
    report = diagnose(load_config(project(base_config(precision=precision, steps=2))), NO_VERIFY)
    assert any("softmax stays in bfloat16 on the CPU" in n for n in report.notes), report.notes


ZEROED = """
import torch.nn.functional as F


def zeroed(model, batch):
    x, y = batch
    return 0.0 * F.cross_entropy(model(x), y)  # a loss that no longer depends on the weights
"""


def test_a_healthy_run_that_learns_nothing_says_so(project):
    path = project(base_config(loss="losses.py:zeroed", steps=12))
    (path.parent / "losses.py").write_text(ZEROED)
    report = diagnose(load_config(path), NO_VERIFY)
    assert report.status == "healthy"
    assert any(n.startswith("the gradient norm was exactly 0 at every step") for n in report.notes)
