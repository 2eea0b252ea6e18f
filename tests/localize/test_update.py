"""The update ratio: how far one optimizer step moved the weights, as the learning-rate
rule reads it. A diverging run's weights grow huge while staying finite: the ratio must
stay a number there, and be infinite only when the update really broke the weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nandoctor.localize.update import update_ratio


def stepped(model: nn.Module, change) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """The parameters with copies of their values, then `change` applied in place."""
    before = [(p, p.detach().clone()) for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            change(p)
    return before


def test_a_small_step_is_its_share_of_the_weights_norm():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    before = stepped(model, lambda p: p.mul_(1.01))
    ratio = update_ratio(model, 3, before)
    # NB: the weights are float32: x * 1.01 rounds, so the ratio is 0.01 to float32's ~1e-7
    # relative precision of each weight, not to 1e-6 of the ratio itself
    assert ratio.step == 3 and ratio.ratio == pytest.approx(0.01, rel=1e-4)


def test_huge_finite_weights_give_a_finite_ratio_not_an_overflow():
    """Weights of 1e22 (a diverging float32 run): their float32 squares overflow, and a
    float32 norm made the ratio inf/inf = NaN, or inf: 'overflowed the weights'."""
    model = nn.Linear(8, 8)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1e22)
    before = stepped(model, lambda p: p.mul_(2.0))
    ratio = update_ratio(model, 10, before)
    assert ratio.ratio == pytest.approx(1.0) and ratio.largest == pytest.approx(1.0)


def test_an_update_that_left_a_weight_nan_is_infinite_and_names_it():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = stepped(model, lambda p: p.add_(0.001))
    with torch.no_grad():
        model[1].bias[0] = math.nan
    ratio = update_ratio(model, 5, before)
    assert math.isinf(ratio.ratio) and ratio.largest_param == "1.bias"


def test_weights_non_finite_before_the_step_measure_nothing():
    model = nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = math.inf
    before = stepped(model, lambda p: p.add_(0.1))
    assert math.isnan(update_ratio(model, 5, before).ratio)


def test_the_largest_is_a_weight_matrix_not_a_zero_initialised_bias():
    """A bias that starts at 0 and moves by 1e-3 has a ratio of 1e9: no evidence of a rate
    too high. The largest named is among the weight matrices."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].bias.zero_()
    before = stepped(model, lambda p: p.add_(1e-3) if p.dim() == 1 else p.mul_(1.1))
    ratio = update_ratio(model, 1, before)
    assert ratio.largest_param.endswith("weight")
    assert ratio.largest == pytest.approx(0.1, rel=1e-4)  # NB: float32 weights, as above
