"""`compare --plot`: panels a reader can use, lines that stay apart, failures labelled."""

from __future__ import annotations

import pytest

from nandoctor.compare import engine
from nandoctor.setup.load import load_config
from tests.helpers.project import base_config

pytest.importorskip("matplotlib")
from nandoctor.render.plot import PALETTE, figure, plot_png


@pytest.fixture
def comparison(project):
    config = base_config(
        steps=4, data_args={"nan_at": 2}, precision={"dtype": "float16", "grad_scaler": True}
    )
    return engine.compare(load_config(project(config)), ["bfloat16", "float32"])


def test_the_panels_scales_and_labels(comparison):
    fig = figure(comparison)
    loss, grad, diff, scale = fig.axes
    assert [a.get_ylabel() for a in fig.axes] == [
        "loss",
        "gradient norm\n(unscaled)",
        "|loss - float32 loss|",
        "loss scale",
    ]
    assert loss.get_yscale() == grad.get_yscale() == diff.get_yscale() == "log"
    assert [line.get_label() for line in scale.get_lines()] == ["float16"]  # the scaler's
    assert [line.get_label() for line in diff.get_lines()] == ["float16", "bfloat16"]
    texts = [t.get_text() for t in loss.texts]
    assert "float16: non-finite at step 2, input" in texts


def test_each_dtype_has_its_own_colour_line_style_and_markers(comparison):
    lines = [line for line in figure(comparison).axes[0].get_lines() if line.get_label()[0] != "_"]
    assert [line.get_color() for line in lines] == PALETTE[:3]
    assert len({line.get_linestyle() for line in lines}) == 3
    assert len({line.get_marker() for line in lines}) == 3


def test_the_png_is_written(comparison):
    assert plot_png(comparison)[:8] == b"\x89PNG\r\n\x1a\n"
