"""Headroom: each module's peaks against float16's limit, of the tensors that must fit."""

from __future__ import annotations

import textwrap

from nandoctor.runtime.fast_run import fast_run
from nandoctor.runtime.headroom import HeadroomProbe
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.conftest import base_config

# A model that returns its loss, as a transformers model given labels does
WITH_LOSS = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

        def forward(self, x, y):
            return F.cross_entropy(self.body(x).float(), y)

    def build_data():
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g))] * 3

    def loss(model, batch):
        return model(*batch)
    """
)


def _peaks(project, dtype: str) -> dict[str, tuple[float | None, float | None]]:
    config = base_config(
        model="train.py:WithLoss", loss="train.py:loss", precision={"dtype": dtype}
    )
    session = build_session(load_config(project(config, WITH_LOSS)))
    probe = HeadroomProbe(session.model, session.dtype)
    fast_run(session, 3, probe=probe, thorough=True)
    return {h.module: (h.activation_absmax, h.gradient_absmax) for h in probe.peaks()}


def test_in_a_float16_run_the_loss_scale_on_the_float32_loss_is_not_headroom(project):
    # the root's output is the float32 loss, its gradient the GradScaler's scale (65536):
    # neither is float16, so neither has to fit in it; the linear layers' outputs do
    peaks = _peaks(project, "float16")
    assert "" not in peaks
    assert {"body", "body.0", "body.2"} <= set(peaks)  # float16 under autocast
    assert all(g is None or g < 65504 for _, g in peaks.values()), peaks


def test_a_float32_run_measures_every_tensor_as_a_forecast_for_float16(project):
    assert {"", "body", "body.0", "body.2"} <= set(_peaks(project, "float32"))
