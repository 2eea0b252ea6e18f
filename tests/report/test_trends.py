"""Trends summarise the telemetry before the failure, ignoring non-finite values."""

from __future__ import annotations

from nandoctor.report.trends import trends_of
from nandoctor.report.types import Event, Telemetry


def telemetry(losses, grads):
    n = len(losses)
    return Telemetry(list(range(n)), list(losses), list(grads), [None] * n)


def test_gradient_growth_is_late_peak_over_early_median():
    t = trends_of(telemetry([1.0] * 20, [1.0] * 10 + [2.0, 5.0] * 4 + [30.0, float("nan")]))
    assert t.grad_early == 1.0 and t.grad_late == 30.0 and t.grad_growth == 30.0


def test_loss_rise_and_late_slope():
    t = trends_of(telemetry([3.0, 2.0, 1.0, 0.5, 0.8, 1.2, 1.6, float("nan")], [1.0] * 8))
    assert (t.loss_min, t.loss_min_step, t.loss_last) == (0.5, 3, 1.6)
    assert t.loss_rise == 3.2 and t.loss_late_slope > 0


def test_skip_streaks():
    events = [Event(s, "scaler-skip", 1.0) for s in (2, 3, 4, 9, 10)]
    t = trends_of(telemetry([1.0] * 12, [1.0] * 12), events)
    assert (t.skips, t.longest_skip_streak) == (5, 3)


def test_empty_telemetry():
    t = trends_of(Telemetry())
    assert t.grad_growth is None and t.loss_rise is None and t.steps == 0
