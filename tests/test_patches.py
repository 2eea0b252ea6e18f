"""Math patches rewrite exactly the pattern they name, count it, and leave the rest."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nandoctor.causes import catalog
from nandoctor.registry import DuplicateError
from nandoctor.runtime.patches import (
    PATCHES,
    EpsilonPatch,
    FiniteMaskPatch,
    LogSoftmaxPatch,
    MathPatch,
    patch_for,
)


def test_log_of_softmax_becomes_log_softmax_in_every_spelling():
    x = torch.tensor([[0.0, 30.0, -30.0]], dtype=torch.float16)
    with LogSoftmaxPatch() as patch:
        a = torch.log(torch.softmax(x, -1))  # nandoctor: ignore[log-of-softmax]
        b = F.softmax(x, dim=-1).log()  # nandoctor: ignore[log-of-softmax]
        c = torch.log(x.softmax(-1))  # nandoctor: ignore[log-of-softmax]
    for y in (a, b, c):
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, F.log_softmax(x, -1))
    assert patch.hits == 3


def test_log_of_something_else_is_left_alone():
    p = torch.tensor([0.5, 0.0])
    with LogSoftmaxPatch() as patch:
        assert torch.log(p)[1] == float("-inf")
    assert patch.hits == 0


def test_a_fully_masked_row_stays_finite_with_a_finite_minimum():
    scores = torch.randn(2, 3)
    mask = torch.tensor([[True, True, True], [False, True, False]])
    with FiniteMaskPatch() as patch:
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)  # nandoctor: ignore
    assert torch.isfinite(probs).all() and patch.hits == 1
    assert probs[1, 1] == 0  # a partly masked row is unchanged


def test_an_epsilon_float16_rounds_to_zero_is_raised():
    x = torch.zeros(4, dtype=torch.float16)
    with EpsilonPatch() as patch:
        y = x / torch.sqrt(x.pow(2).mean() + 1e-8)
        z = F.layer_norm(torch.zeros(2, 4, dtype=torch.float16), (4,), eps=1e-9)
    assert torch.isfinite(y).all() and torch.isfinite(z).all()
    assert patch.hits == 2


def test_an_epsilon_the_dtype_holds_is_left_alone():
    with EpsilonPatch() as patch:
        torch.zeros(4) + 1e-8  # float32 holds 1e-8
        torch.zeros(4, dtype=torch.float16) + 1e-3
    assert patch.hits == 0


def test_patches_are_registered_by_cause_id_once():
    assert {
        "log-of-softmax": LogSoftmaxPatch,
        "fully-masked-softmax": FiniteMaskPatch,
        "eps-underflow": EpsilonPatch,
    } == PATCHES
    for cause_id in PATCHES:
        catalog.get(cause_id)

    class AnotherLogSoftmax(MathPatch):
        describe = "a second rewrite of log(softmax(x))"

    first = r"first by nandoctor\.runtime\.patches\.LogSoftmaxPatch, again by .*AnotherLogSoftmax"
    with pytest.raises(DuplicateError, match=first):
        patch_for("log-of-softmax")(AnotherLogSoftmax)
    assert PATCHES["log-of-softmax"] is LogSoftmaxPatch
