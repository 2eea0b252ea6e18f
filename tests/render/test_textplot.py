"""The overlaid text plot puts each series on shared axes and marks non-finite points."""

from __future__ import annotations

from nandoctor.render.textplot import overlay


def test_two_series_share_the_axes_and_nan_is_marked():
    lines = overlay(
        {"a": ([0, 1, 2], [1.0, 2.0, 3.0]), "b": ([0, 1, 2], [3.0, 2.0, float("nan")])},
        {"a": "a", "b": "b"},
        width=3,
        height=3,
    )
    assert lines[0] == "3 ┤b a" or lines[0].startswith("3 ┤")
    assert "×" in lines[0]  # b's NaN at the last column, on the top row
    assert lines[-2].strip().startswith("└") and lines[-1].strip() == "0 2"


def test_no_finite_value_no_plot():
    assert overlay({"a": ([0], [float("nan")])}, {"a": "a"}) == []
