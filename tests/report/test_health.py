"""Health summarises a run: grad-norm percentiles, skips, final loss, module peaks."""

from __future__ import annotations

from nandoctor.report.health import Headroom, health_of
from nandoctor.report.telemetry import Event, Telemetry


def test_health_of_a_run():
    t = Telemetry(
        list(range(10)),
        [2.0 - 0.1 * i for i in range(10)],
        [float(i + 1) for i in range(10)],
        [None] * 10,
    )
    peaks = [
        Headroom("b", "Linear", 100.0, 3, 5.0, 4, order=1),
        Headroom("a", "Linear", 40000.0, 7, 1.0, 2, order=0),
    ]
    h = health_of(t, [Event(2, "scaler-skip", 1.0), Event(3, "scaler-skip", 0.5)], peaks)
    assert (h.grad_norm.p50, h.grad_norm.p90, h.grad_norm.max) == (5.0, 9.0, 10.0)
    assert (h.scaler_skips, h.longest_skip_streak) == (2, 2)
    assert h.final_loss == sum(2.0 - 0.1 * i for i in range(5, 10)) / 5  # the last 5 steps
    assert [m.module for m in h.modules] == ["a", "b"]  # sorted: diff-friendly
    assert h.headroom_module == "a" and round(h.headroom, 3) == round(40000 / 65504, 3)
