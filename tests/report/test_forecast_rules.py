"""The forecast's rules on plain numbers: a trend fitted on a log scale, each rule's bar,
the GradScaler's skips, the loss's z-score, and the forecaster that fires each forecast
once (report/trend.py, report/forecast_rules.py, report/forecaster.py)."""

from __future__ import annotations

import math

import pytest

from nandoctor.report import forecast_rules as rules
from nandoctor.report.forecast import Forecast, best_first, fails_by_forecast, forecast_text
from nandoctor.report.forecaster import Forecaster, LossZ
from nandoctor.report.limits import overflow_limit, underflow_spread
from nandoctor.report.signals import (
    ACTIVATION_PEAK,
    SOFTMAX_SPREAD,
    UPDATE_RATIO,
    Layout,
    Site,
)
from nandoctor.report.trend import growth

PEAK16 = Site(ACTIVATION_PEAK, "blocks.3.fc2", None, "float16", 65504.0)
SPREAD16 = Site(SOFTMAX_SPREAD, None, "aten._softmax.default", "float16", 17.33, logged=True)


def geometric(start: float, rate: float, steps: int, first: int = 0) -> list[tuple[int, float]]:
    return [(first + i, start * rate**i) for i in range(steps)]


def test_a_geometric_series_is_fitted_exactly_and_crosses_its_limit_where_it_should():
    g = growth(geometric(100.0, 2.0, 4), limit=6400.0)
    assert g is not None
    assert (round(g.rate, 6), round(g.eta, 6), round(g.r2, 6)) == (2.0, 3.0, 1.0)


def test_a_falling_or_flat_signal_has_no_growth():
    assert growth(geometric(100.0, 0.9, 20), limit=65504.0) is None
    assert growth([(i, 5.0) for i in range(20)], limit=65504.0) is None


def test_the_limits_are_where_float16_overflows_and_a_softmax_underflows():
    assert overflow_limit("float16") == 65504.0
    assert overflow_limit("float32") == pytest.approx(math.sqrt(3.4028234663852886e38))
    assert underflow_spread("float16") == pytest.approx(25 * math.log(2))  # 17.33
    assert underflow_spread("float32") == pytest.approx(150 * math.log(2))  # 103.97


def test_underflow_spread_is_where_torch_s_softmax_rounds_the_smallest_probability_to_0():
    torch = pytest.importorskip("torch")
    for name, dtype in (("float16", torch.float16), ("float32", torch.float32)):
        limit = underflow_spread(name)
        below = torch.softmax(torch.tensor([[0.0, -(limit - 0.1)]], dtype=dtype), -1)
        above = torch.softmax(torch.tensor([[0.0, -(limit + 0.1)]], dtype=dtype), -1)
        assert below[0, 1] > 0 and above[0, 1] == 0, name


def test_a_module_peak_growing_6_percent_a_step_near_float16_s_limit_is_forecast():
    points = geometric(8100.0 / 1.06**20, 1.06, 21, first=130)  # 8100 at step 150
    claim = rules.activation_peak(points, PEAK16)
    assert claim is not None
    assert claim.kind == "fp16-overflow" and claim.limit == 65504.0
    assert claim.eta == round(math.log(65504 / 8100) / math.log(1.06))  # 36 steps
    assert "grew 1.06x a step over the last 21 steps" in claim.why


def test_a_peak_far_below_its_limit_is_not_extrapolated_that_far():
    """Growing 6% a step from 20: the crossing is ~140 steps out, beyond the horizon and
    beyond twice the steps the trend was seen for."""
    assert rules.activation_peak(geometric(20.0, 1.06, 21), PEAK16) is None


def test_a_noisy_peak_is_no_trend():
    noisy = [(i, 30000.0 * (1.5 if i % 2 else 0.7)) for i in range(24)]
    assert rules.activation_peak(noisy, PEAK16) is None


def test_a_softmax_spreading_towards_its_underflow_is_a_log_of_softmax_forecast_if_logged():
    points = geometric(0.5, 1.3, 14)  # 15.1 at step 13
    claim = rules.softmax_spread(points, SPREAD16)
    assert claim is not None and claim.kind == "log-of-softmax"
    unlogged = Site(SOFTMAX_SPREAD, "attn", "aten._softmax.default", "float16", 17.33)
    assert rules.softmax_spread(points, unlogged) is None  # an attention's: no log of it


def test_the_loss_scale_collapsing_after_its_calibration_is_forecast():
    """One skip in three steps, each halving the scale from 2**12: about 12 halvings left."""
    recent = [(s, 2.0 ** (12 - s // 3), s % 3 == 2) for s in range(24)]
    claim = rules.loss_scale(recent, min_scale=1.0, calibrated=True)
    assert claim is not None and claim.kind == "grad-scaler-collapse"
    assert 0 < claim.eta <= 60


def test_skips_of_the_calibration_or_a_scale_that_grows_back_are_benign():
    calibrating = [(s, 65536.0 / 2**s, True) for s in range(20)]
    assert rules.loss_scale(calibrating, 1.0, calibrated=False) is None
    regrowing = [(s, 2.0**10 * (2 if s > 20 else 1), s in (3, 9, 15, 19)) for s in range(32)]
    assert rules.loss_scale(regrowing, 1.0, calibrated=True) is None


def test_the_loss_z_score_is_zclip_s_ema_form():
    z = LossZ()
    scores = [z.update(2.0 + 0.01 * (-1) ** i) for i in range(40)]
    assert scores[:25] == [None] * 25  # the warmup only feeds the averages
    assert all(abs(s) < 3 for s in scores[25:] if s is not None)
    assert z.update(4.0) > 10  # a spike, far above its recent level


def layout_of(*sites: Site) -> Layout:
    return Layout(others=sites)


def test_the_forecaster_fires_once_per_cause_module_and_metric_with_an_event():
    f = Forecaster()
    fired: list[Forecast] = []
    for step, value in geometric(1000.0, 1.1, 30):
        fired += f.observe(step, 2.0, 1.0, None, False, (Layout(peaks=(PEAK16,)), [value, 0.0]))
    assert len(fired) == 1 and f.forecasts == fired
    forecast = fired[0]
    where = (forecast.kind, forecast.module, forecast.metric)
    assert where == ("fp16-overflow", PEAK16.module, ACTIVATION_PEAK)
    assert forecast.event().kind == "forecast" and forecast.event().cause == "fp16-overflow"
    assert forecast.due == forecast.step + forecast.eta_steps


def test_a_healthy_run_with_warmup_and_a_plateau_carries_no_forecast():
    """Peaks that rise during a warmup and level off, an update ratio near 1e-3, a loss that
    falls to its floor: nothing to forecast."""
    f = Forecaster()
    group = Site(UPDATE_RATIO, "param_groups.0", None, "float32", 1.0)
    for step in range(300):
        peak = 50.0 * min(1.0, (step + 1) / 40)
        loss = 0.3 + 2.0 * math.exp(-step / 30)
        layout = Layout(peaks=(PEAK16,), updates=(0,))
        ratio = 1e-3 * min(1.0, (step + 1) / 40)
        values = [peak, -peak, ratio, 1.0]
        assert not f.observe(step, loss, 1.0, None, False, (layout, values))
    assert group not in f._series or all(v < 0.01 for _, v in f._series[group])


def test_a_layout_reads_peaks_others_and_update_ratios_per_group():
    layout = Layout(peaks=(PEAK16,), others=(SPREAD16,), updates=(0, 0, 1))
    values = [412.0, -498.5, 11.2, 3.0, 4.0, 1.0, 30.0, 40.0, 10.0]
    read = dict(layout.read(values))
    assert read[PEAK16] == 498.5 and read[SPREAD16] == 11.2
    ratios = {s.module: v for s, v in read.items() if s.metric == UPDATE_RATIO}
    assert ratios == {"param_groups.0": pytest.approx(0.1), "param_groups.1": pytest.approx(0.1)}


def test_forecasts_read_best_first_and_fail_a_run_only_when_asked():
    a = Forecast(10, "fp16-overflow", "fc", None, ACTIVATION_PEAK, 1.0, 2.0, 30, 0.6, "")
    b = Forecast(12, "log-of-softmax", None, "op", SOFTMAX_SPREAD, 1.0, 2.0, 5, 0.8, "")
    assert best_first([a, b]) == [b, a]
    assert fails_by_forecast([a], True) and not fails_by_forecast([a], False)
    assert not fails_by_forecast([], True)
    assert forecast_text(b).startswith("step 12: log-of-softmax in about 5 steps (step 17), ")


def test_a_gradient_norm_or_a_loss_growing_geometrically_is_forecast_before_it_overflows():
    """The gradient norm's float32 square overflows past 1.8e19; a loss past 3.4e38."""
    grads = rules.grad_norm(geometric(1e8, 1.8, 20), Forecaster().grad_site)
    assert grads is not None and grads.kind == "exploding-gradients"
    assert grads.limit == pytest.approx(1.8446744e19, rel=1e-6)
    loss = rules.loss(geometric(1e20, 3.0, 14), Forecaster().loss_site)
    assert loss is not None and loss.kind == "learning-rate-too-high"
    assert rules.grad_norm(geometric(1.0, 1.05, 20), Forecaster().grad_site) is None  # far off


def test_growth_that_levels_off_is_no_forecast():
    """A warmup's end: 20% a step, then 2%; a straight fit would still cross the limit."""
    points = geometric(3000.0, 1.2, 12) + geometric(3000.0 * 1.2**11 * 1.02, 1.02, 12, first=12)
    assert rules.activation_peak(geometric(3000.0, 1.2, 24), PEAK16) is not None
    assert rules.activation_peak(points, PEAK16) is None
