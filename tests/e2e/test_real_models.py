"""The tracer on real architectures (tiny, random-init transformers models on the CPU):
the causal origin of each designed failure, the values that heal on the way listed and
never blamed, the library line and the user's, and the same report on every run.

The models and their failures are in tests/helpers/real_models.py; the expected lines are found
independently, by the marker comment on them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml

from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.report.types import Report
from nandoctor.setup.load import load_config
from tests.helpers import real_models

pytest.importorskip("transformers")

RUNS = 3  # same config, same report, every time
HELPER = Path(real_models.__file__)


def line_of(marker: str) -> int:
    for number, line in enumerate(HELPER.read_text().splitlines(), start=1):
        if re.search(rf"# marker:{marker}\b", line):
            return number
    raise AssertionError(marker)


def config(tmp_path: Path, name: str, dtype: str, loss: str | None = None, steps: int = 4) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        f"model: tests.helpers.real_models:{name}\n"
        f"data: tests.helpers.real_models:{DATA[name]}\n"
        f"data_args: {{batches: {steps}}}\n"
        f"loss: tests.helpers.real_models:{loss or LOSS[name]}\n"
        "optimizer: {name: AdamW, lr: 1.0e-3}\n"
        f"precision: {{dtype: {dtype}}}\n"
        f"steps: {steps}\n"
        "device: cpu\n"
    )
    return path


def float16_config(
    tmp_path: Path,
    loss: str,
    steps: int,
    lr: float = 1e-3,
    data: str = "lm_data",
    model: str = "gpt2",
) -> Path:
    """GPT-2 (no dropout) under float16 autocast with the CPU's own lists and a
    GradScaler, as a CPU script trains it."""
    path = tmp_path / "gpt2.yaml"
    config = {
        "model": f"tests.helpers.real_models:{model}",
        "data": f"tests.helpers.real_models:{data}",
        "data_args": {"batches": 8},
        "loss": f"tests.helpers.real_models:{loss}",
        "optimizer": {"name": "AdamW", "lr": lr},
        "precision": {"dtype": "float16", "grad_scaler": True, "autocast_policy": "native"},
        "steps": steps,
        "device": "cpu",
    }
    if model == "gpt2":
        config["model_args"] = {"dropout": 0.0}
    path.write_text(yaml.safe_dump(config))
    return path


DATA = {"gpt2": "lm_data", "t5": "seq2seq_data", "bert": "mlm_data"}
LOSS = {"gpt2": "gpt2_consistency_loss", "t5": "t5_contrastive_loss", "bert": "mlm_loss"}


def reports(path: Path) -> list[Report]:
    loaded = load_config(path)
    return [diagnose(loaded, DiagnoseOptions(verify=False)) for _ in range(RUNS)]


def same_every_time(runs: list[Report]) -> Report:
    first, *others = [{k: v for k, v in r.to_dict().items() if k != "timing"} for r in runs]
    for other in others:
        assert other == first
    return runs[0]


def user_line(report: Report) -> tuple[str, int]:
    path, _, line = report.first_nonfinite.source.rpartition(":")
    return Path(path).name, int(line)


def test_gpt2_with_sdpa_and_dropout_sqrt_at_zero_in_the_backward(tmp_path):
    report = same_every_time(reports(config(tmp_path, "gpt2", "bfloat16")))
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (0, "backward", None)
    assert (first.op, first.tensor) == ("aten.div.Tensor", "grad_input")
    assert report.evidence.backward_of == "torch.sqrt (SqrtBackward0)"
    assert user_line(report) == (HELPER.name, line_of("gpt2-sqrt"))
    # dropout's buffers are allocated with empty_like: never a value, never listed
    assert not any("empty" in (t.op or "") for t in report.transients)
    assert report.causes[0].id == "nondifferentiable-point"


def test_gpt2_in_float16_the_nan_the_grad_scaler_skips_is_the_failure_at_its_step(tmp_path):
    """The GradScaler skips step 0 (NaN gradients) as it would an overflow; rerun at loss
    scale 1 its gradients are still NaN: the failure, at that step, traced unscaled."""
    report = same_every_time(reports(config(tmp_path, "gpt2", "float16")))
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (0, "backward", None)
    assert (first.op, first.tensor) == ("aten.div.Tensor", "grad_input")
    assert report.evidence.backward_of == "torch.sqrt (SqrtBackward0)"
    assert user_line(report) == (HELPER.name, line_of("gpt2-sqrt"))
    assert report.events == [] and "the scaler hid a real failure" in report.summary
    assert any("replayed at loss scale 1" in note for note in report.notes)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt2_with_a_hand_written_sharp_softmax_overflows_float32_as_its_logits_grow(
    tmp_path, dtype
):
    """exp(logits / 0.0075) stays finite while training starts, then the logits grow past
    88.7 * 0.0075: the failure is that step's exp, and no dtype switch is offered (bfloat16
    shares float32's range)."""
    report = same_every_time(reports(config(tmp_path, "gpt2", dtype, "gpt2_sharpened_loss", 8)))
    first = report.first_nonfinite
    assert first.step > 0 and all(math.isfinite(x) for x in report.telemetry.loss[: first.step])
    assert (first.phase, first.op, first.value) == ("loss", "aten.exp.default", "inf")
    assert user_line(report) == (HELPER.name, line_of("gpt2-exp"))
    cause = report.causes[0]
    assert cause.id == "float32-overflow" and cause.verified is None
    argument = float(re.search(r"arguments up to ([\d.]+)", cause.evidence[0]).group(1))
    assert argument > 88.7 and "overflows float32 (and bfloat16) above 88.7" in cause.evidence[0]


def test_gpt2_in_float16_a_log_of_softmax_whose_minus_inf_is_discarded_fails_in_its_backward(
    tmp_path,
):
    """The textbook mistake at its subtlest: the gather of the target's column throws
    log(0) away, and the backward of log divides by that 0. The cause is the log of the
    softmax (its fix verified), and that log is not listed as a value seen on the way."""
    path = float16_config(
        tmp_path, "gpt2_hand_written_log_softmax_loss", steps=80, lr=3e-2, data="counting_data"
    )
    report = same_every_time(reports(path))
    first = report.first_nonfinite
    assert (first.phase, first.op, first.value) == ("backward", "aten.div.Tensor", "nan")
    assert report.evidence.backward_of == "torch.log (LogBackward0)"
    assert user_line(report) == (HELPER.name, line_of("gpt2-log"))
    assert not any(t.op == "aten.log.default" for t in report.transients)
    cause = report.causes[0]
    assert cause.id == "log-of-softmax"
    assert "exact zero" in cause.evidence[0] and "aten._softmax.default" in cause.evidence[0]
    verified = diagnose(load_config(path)).causes[0]
    assert verified.id == "log-of-softmax" and verified.verified is True


def test_gpt2_in_float16_an_overflow_in_the_backward_of_gelus_pow_is_fp16_overflow(tmp_path):
    """pow is steep only below exponent 1; pow(x, 3)'s backward overflows float16 and is
    finite in float32: the precision, with bfloat16 the verified fix, not a point of
    infinite derivative."""
    path = float16_config(tmp_path, "lm_loss", steps=2, model="gpt2_with_a_hot_mlp")
    report = same_every_time(reports(path))
    first = report.first_nonfinite
    assert (first.step, first.phase, first.op) == (0, "backward", "aten.pow.Tensor_Scalar")
    assert first.module == "transformer.h.1.mlp.act"
    assert report.evidence.backward_of == "torch.pow (PowBackward0)"
    assert report.evidence.recompute is not None and report.evidence.recompute.finite
    assert "nondifferentiable-point" not in [c.id for c in report.causes]
    verified = diagnose(load_config(path)).causes[0]
    assert verified.id == "fp16-overflow" and verified.verified is True


def test_gpt2_in_float16_an_exp_overflow_that_healed_into_a_log_of_zero_is_suspected(tmp_path):
    """The log is the origin (the inf healed into its zero, and the tracer follows
    values, not zeros), but the cause is the overflow upstream: bfloat16 holds (verified),
    the clamp of the log does not."""
    path = float16_config(tmp_path, "gpt2_info_nce_loss", steps=4)
    report = same_every_time(reports(path))
    first = report.first_nonfinite
    assert (first.step, first.phase, first.op) == (0, "loss", "aten.log.default")
    assert user_line(report) == (HELPER.name, line_of("gpt2-info-nce-log"))
    exp = [t for t in report.transients if t.op == "aten.exp.default"]
    assert exp and exp[0].source.endswith(f":{line_of('gpt2-info-nce-exp')}")
    causes = diagnose(load_config(path)).causes
    assert (causes[0].id, causes[0].verified) == ("fp16-overflow", True)
    assert next(c for c in causes if c.id == "log-of-zero").verified is False


def test_t5_takes_log_of_zero_every_step_and_it_is_never_the_origin(tmp_path):
    report = same_every_time(reports(config(tmp_path, "t5", "float32")))
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (real_models.BAD_STEP, "loss", None)
    assert (first.op, first.value) == ("aten.div.Tensor", "nan")
    assert user_line(report) == (HELPER.name, line_of("t5-norm"))
    healed = {(t.module, t.op, t.phase, t.value) for t in report.transients}
    assert healed == {
        (f"{stack}.block.0.layer.0.SelfAttention", "aten.log.default", "forward", "-inf")
        for stack in ("encoder", "decoder")
    }
    assert report.causes[0].id == "division-by-zero"


def test_bert_with_a_padding_mask_and_nothing_to_predict_fails_inside_the_library(tmp_path):
    report = same_every_time(reports(config(tmp_path, "bert", "float32")))
    first = report.first_nonfinite
    assert (first.step, first.phase, first.module) == (real_models.BAD_STEP, "forward", "")
    assert (first.op, first.value) == ("aten.nll_loss_forward.default", "nan")
    functional, modeling, user = first.frames
    assert (functional.file, functional.user) == ("torch/nn/functional.py", False)
    assert (modeling.file, modeling.user) == ("transformers/models/bert/modeling_bert.py", False)
    assert (Path(user.file).name, user.line, user.user) == (HELPER.name, line_of("bert-loss"), True)
    assert first.source == f"{user.file}:{user.line}"
    assert report.transients == []  # the mask adds the dtype's minimum: finite, nothing healed
