"""`compare` runs the same batches from the same weights under each dtype, through the
same loop as diagnose, and says which survived."""

from __future__ import annotations

import io
import json

from rich.console import Console

from nandoctor.compare.engine import compare
from nandoctor.render.compare import render_comparison
from nandoctor.report.comparison import Comparison
from nandoctor.setup.load import load_config
from tests.helpers.paths import CONFIGS
from tests.helpers.project import TRAIN_PY, base_config

RECORDING = """
import hashlib

import torch
from torch import nn

SEEN = []


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))


def build_loader():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)


def recording_loss(model, batch):
    x, y = batch
    SEEN.append(hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest())
    return nn.functional.cross_entropy(model(x), y)
"""


def test_every_run_sees_the_same_batches_in_the_same_order(project, tmp_path):
    path = project(
        base_config(
            model="rec.py:build_model",
            data="rec.py:build_loader",
            loss="rec.py:recording_loss",
            steps=20,
        )
    )
    (tmp_path / "rec.py").write_text(RECORDING)
    comparison = compare(load_config(path), ["bf16", "fp16"])
    import sys

    seen = next(
        m for name, m in sys.modules.items() if name.startswith("_nandoctor_user_rec_")
    ).SEEN
    runs = [seen[i * 20 : (i + 1) * 20] for i in range(3)]
    assert [r.dtype for r in comparison.runs] == ["float32", "bfloat16", "float16"]
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0][:8])) == 8 and runs[0][:8] != runs[0][8:16]  # shuffled anew each epoch


def test_fp16_overflow_example_bf16_survives_where_fp16_fails():
    comparison = compare(load_config(CONFIGS / "fp16-overflow.yaml"), ["bf16"])
    fp16, bf16 = comparison.run("float16"), comparison.run("bfloat16")
    assert fp16.status == "nonfinite" and fp16.first_nonfinite_phase == "forward"
    assert bf16.status == "healthy"
    assert fp16.headroom[0].peak_fraction > 0.5  # it was near 65504 when it failed
    assert comparison.verdict.startswith("bfloat16 survived all")
    assert "switch autocast to bfloat16" in comparison.verdict


# The second layer's output leaves float16's range at step 0 (a bias of 70000): all inf,
# so its finite peak is 0%; the first layer's is the largest finite one
OVERFLOWS = """
import torch
from torch import nn


def build_model():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 3))
    with torch.no_grad():
        model[0].bias.fill_(4.0)
        model[1].bias.fill_(7e4)
    return model
"""


def test_the_headroom_names_the_module_that_went_non_finite_not_the_largest_finite_peak(
    project,
):
    path = project(base_config(precision={"dtype": "float16"}, steps=3), TRAIN_PY + OVERFLOWS)
    comparison = compare(load_config(path), ["bf16"])
    fp16 = comparison.run("float16")
    assert (fp16.first_nonfinite_step, fp16.first_nonfinite_phase) == (0, "forward")
    assert fp16.headroom[0].module == "0"  # the largest finite peak: not where it broke
    assert fp16.nonfinite_module == "1"
    assert "float16 went non-finite at step 0 (phase forward), first in the output of 1" in (
        comparison.verdict
    )
    assert "of float16's range in 0" not in comparison.verdict
    out = io.StringIO()
    render_comparison(Console(file=out, width=200), comparison)
    assert "non-finite in 1 at step 0" in out.getvalue() and "% in 0" not in out.getvalue()
    read_back = Comparison.from_dict(json.loads(comparison.to_json())).run("float16")
    assert (read_back.nonfinite_module, read_back.headroom) == ("1", fp16.headroom)


def test_seed_example_fails_in_every_dtype_so_the_dtype_is_not_the_cause():
    comparison = compare(load_config(CONFIGS / "seed-fp16-nan.yaml"), ["bf16", "fp32"])
    assert all(r.status == "nonfinite" for r in comparison.runs)
    assert "the dtype is not the cause" in comparison.verdict
    fp16, fp32 = comparison.run("float16"), comparison.run("float32")
    assert fp16.first_nonfinite_step < fp32.first_nonfinite_step
    assert comparison.reference == "float32" and fp32.max_abs_loss_diff_vs_reference == 0.0


def test_json_has_the_spec_shape_and_round_trips(project):
    comparison = compare(load_config(project(base_config(steps=5))), ["bf16"])
    data = json.loads(comparison.to_json())
    assert data["schema_version"] == 1 and data["command"] == "compare"
    assert data["environment"]["autocast_policy"] == "cuda"  # the lists its runs followed
    spec_keys = {
        "dtype",
        "status",
        "steps_completed",
        "first_nonfinite_step",
        "final_loss",
        "max_abs_loss_diff_vs_reference",
        "step_time_ms",
    }
    for run in data["runs"]:
        assert spec_keys <= set(run)
        assert {"activation_fraction", "gradient_fraction"} <= set(run["headroom"][0])
    assert isinstance(data["verdict"], str) and data["verdict"]
    assert Comparison.from_dict(data).to_dict() == data


def test_runs_are_reproducible(project):
    a = compare(load_config(project(base_config(steps=8))), ["bf16"])
    b = compare(load_config(project(base_config(steps=8))), ["bf16"])
    for x, y in zip(a.runs, b.runs, strict=True):
        assert x.telemetry.loss == y.telemetry.loss and x.headroom == y.headroom


HIDDEN_NAN = """
import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))


def build_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(8)]


def sqrt_loss(model, batch):
    x, y = batch
    out = model(x).float()
    distance = torch.sqrt(((out - out.detach()) ** 2).sum())  # sqrt at 0: NaN gradients
    return ((out - y) ** 2).mean() + distance
"""


def test_a_nan_the_grad_scaler_skips_is_the_float16_runs_failure_not_health(project):
    # the scaler skips every step (NaN gradients at any scale): rechecked at loss scale 1,
    # as diagnose does, step 0 is the failure, where unchecked skips looked healthy
    config = base_config(loss="train.py:sqrt_loss", precision={"dtype": "float16"}, steps=8)
    comparison = compare(load_config(project(config, HIDDEN_NAN)), ["bf16"])
    float16 = comparison.runs[0]
    assert (float16.dtype, float16.status) == ("float16", "nonfinite")
    assert (float16.first_nonfinite_step, float16.first_nonfinite_phase) == (0, "backward")
