"""A what-if for every fix the report offers, on real architectures (tiny random-init
transformers models on the CPU): the fix is replayed where nandoctor can apply it itself,
and where it cannot, the report says why. The models and their failures are in
tests/helpers/real_fixes.py and tests/helpers/real_models.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nandoctor.diagnose.engine import diagnose
from nandoctor.report.types import Cause, Report
from nandoctor.setup.load import load_config
from tests.helpers import real_fixes, real_models

pytest.importorskip("transformers")


def write(tmp_path: Path, **config) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"device": "cpu", **config}, sort_keys=False))
    return path


def cause(report: Report, cause_id: str) -> Cause:
    return next(c for c in report.causes if c.id == cause_id)


def test_bert_a_masked_lm_batch_with_nothing_masked_is_replayed_with_a_mean_over_some(tmp_path):
    """The 0/0 is inside the library: BERT's own cross-entropy averages over no target.
    Guarding that call at transformers' line (the summed loss over at least one target)
    is the replay of "divide the summed loss by max(count, 1)"."""
    path = write(
        tmp_path,
        model="tests.helpers.real_models:bert",
        data="tests.helpers.real_models:mlm_data",
        data_args={"batches": 4},
        loss="tests.helpers.real_models:mlm_loss",
        optimizer={"name": "AdamW", "lr": 1e-3},
        precision={"dtype": "float32"},
        steps=4,
    )
    report = diagnose(load_config(path))
    assert report.first_nonfinite.step == real_models.BAD_STEP
    division = cause(report, "division-by-zero")
    assert division.verified is True
    assert division.verification.startswith(
        "with the nll_loss at modeling_bert.py:"
    ) and "guarded (a mean over no target taken as 0), applied from step 0, 34/34 steps " in (
        division.verification
    )


def test_gpt2_half_resumed_with_adam_from_a_float32_checkpoint_has_its_eps_raised_after_loading(
    tmp_path,
):
    """`optimizer.load_state_dict` brings back eps=1e-8, which is 0 in float16: the
    config's eps (1e-4 here) changes nothing, and the replay with a raised eps in the
    config alone failed at the next step as the run did. Raised once the checkpoint is
    loaded, it holds."""
    checkpoint = tmp_path / "float32.pt"
    real_fixes.save_float32_checkpoint(checkpoint)
    path = write(
        tmp_path,
        model="tests.helpers.real_fixes:gpt2_half",
        data="tests.helpers.real_models:lm_data",
        data_args={"batches": 8},
        loss="tests.helpers.real_models:lm_loss",
        optimizer={"name": "Adam", "lr": 1e-3, "eps": 1e-4},
        precision={"dtype": "float32"},
        checkpoint=str(checkpoint),
        steps=8,
    )
    report = diagnose(load_config(path))
    first = report.first_nonfinite
    assert (first.step, first.phase) == (3, "optimizer")
    eps = cause(report, "eps-underflow")
    assert eps.evidence == [
        "the optimizer's eps=1e-08 is 0 in the float16 parameters' dtype, so "
        "aten.addcdiv_.default divided by 112 exact zeros"
    ]
    assert eps.verified is True
    assert eps.verification.startswith(
        "with the optimizer's eps raised to 6.10352e-05, applied from step 3, 33/33 steps "
        "stayed finite, to step 35, past the failing step 3"
    ), eps.verification


def sentence_encoder(tmp_path: Path) -> Path:
    return write(
        tmp_path,
        model="tests.helpers.real_fixes:sentence_encoder",
        data="tests.helpers.real_fixes:sentence_pairs",
        loss="tests.helpers.real_fixes:contrastive_loss",
        optimizer={"factory": "tests.helpers.real_fixes:fast_scalars", "lr": 1e-3},
        precision={"dtype": "float32"},
        steps=12,
    )


def test_a_learnable_logit_scale_that_grew_until_exp_overflowed_is_replayed_capped(tmp_path):
    """GPT-2 sentence embeddings scored with `logit_scale.exp()`: the scale climbs past
    88.7 and exp overflows float32, where running it in float32 is no guard. The fix the
    report offers, `logit_scale.clamp(max=math.log(100))`, is replayed."""
    report = diagnose(load_config(sentence_encoder(tmp_path)))
    first = report.first_nonfinite
    assert (first.op, first.value, first.dtype) == ("aten.exp.default", "inf", "float32")
    assert first.source.endswith(f"real_fixes.py:{marked('logit-scale-exp')}")
    overflow = cause(report, "float32-overflow")
    assert "logit_scale.clamp(max=math.log(100))" in overflow.fix
    assert overflow.verified is True
    assert overflow.verification.startswith(
        f"with the exp at real_fixes.py:{marked('logit-scale-exp')} guarded (its learnable "
        "scale capped at ln(100), as CLIP caps its logit scale), applied from step 0, "
    ), overflow.verification


def test_an_exp_of_activations_that_overflowed_float32_says_why_it_is_not_replayed(tmp_path):
    """exp(logits / 0.0075) of GPT-2's logits: no learnable scale to cap, and float32 is
    the dtype it overflowed. No replay, and the sentence says why."""
    path = write(
        tmp_path,
        model="tests.helpers.real_models:gpt2",
        data="tests.helpers.real_models:lm_data",
        data_args={"batches": 8},
        loss="tests.helpers.real_models:gpt2_sharpened_loss",
        optimizer={"name": "AdamW", "lr": 1e-3},
        precision={"dtype": "float32"},
        steps=8,
    )
    overflow = cause(diagnose(load_config(path)), "float32-overflow")
    assert overflow.verified is None
    assert overflow.verification == (
        "not replayed: the exp overflowed float32, so running it in float32 changes nothing, "
        "and its argument has no bound nandoctor could choose for you (only a learnable "
        "scale, one value, has one): rewrite it in log space"
    )


def test_gpt2_gradients_that_overflow_inside_the_backward_are_replayed_with_a_smaller_rate(
    tmp_path,
):
    """GPT-2 in float16 with no GradScaler, clipping at 1.0, SGD at a rate that lets its
    hot MLP's weights grow until GELU's backward overflows float16: the clip acts after
    the backward and cannot stop it (no replay of a clip it already has), while the
    report's fix, a lower rate or bfloat16, can be replayed."""
    path = write(
        tmp_path,
        model="tests.helpers.real_models:gpt2_with_a_hot_mlp",
        model_args={"scale": 300},
        data="tests.helpers.real_models:lm_data",
        data_args={"batches": 8},
        loss="tests.helpers.real_models:lm_loss",
        optimizer={"name": "SGD", "lr": 0.3},
        precision={"dtype": "float16", "grad_scaler": False, "autocast_policy": "native"},
        clip_grad_norm=1.0,
        steps=20,
    )
    report = diagnose(load_config(path))
    first = report.first_nonfinite
    assert first.phase == "backward" and first.step > 0
    exploding = cause(report, "exploding-gradients")
    assert "the gradients themselves overflowed in backward" in " ".join(exploding.evidence)
    assert exploding.verified is True
    assert "with a 10x smaller learning rate (0.03)" in exploding.verification
    assert "steps stayed finite" in exploding.verification


def marked(marker: str) -> int:
    source = Path(real_fixes.__file__).read_text().splitlines()
    return next(i for i, line in enumerate(source, start=1) if f"# marker:{marker}" in line)
