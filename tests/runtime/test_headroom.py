"""Headroom: each module's peaks against float16's limit, of the tensors that must fit."""

from __future__ import annotations

import textwrap

from nandoctor.runtime.fast_run import fast_run
from nandoctor.runtime.headroom import HeadroomProbe, went_nonfinite_in
from nandoctor.setup.load import load_config
from nandoctor.setup.session import build_session
from tests.helpers.project import base_config

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


# Its second layer's output leaves float16's range (a bias of 70000 > 65504) at step 0:
# that output is all inf, and so is the third layer's, which only received it
OVERFLOWS = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Overflows(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.l3 = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(3, 3)
            with torch.no_grad():
                self.l2.bias.fill_(7e4)

        def forward(self, x, y):
            return F.cross_entropy(self.l3(self.l2(self.l1(x))).float(), y)

    def build_data():
        g = torch.Generator().manual_seed(0)
        return [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g))] * 3

    def loss(model, batch):
        return model(*batch)
    """
)


def _probe(project, dtype: str, model: str = "WithLoss", source: str = WITH_LOSS) -> HeadroomProbe:
    config = base_config(
        model=f"train.py:{model}", loss="train.py:loss", precision={"dtype": dtype}
    )
    session = build_session(load_config(project(config, source)))
    probe = HeadroomProbe(session.model, session.dtype)
    fast_run(session, 3, probe=probe, thorough=True)
    return probe


def _peaks(project, dtype: str) -> dict[str, tuple[float | None, float | None]]:
    return {
        h.module: (h.activation_absmax, h.gradient_absmax) for h in _probe(project, dtype).peaks()
    }


def test_in_a_float16_run_the_loss_scale_on_the_float32_loss_is_not_headroom(project):
    # the root's output is the float32 loss, its gradient the GradScaler's scale (65536):
    # neither is float16, so neither has to fit in it; the linear layers' outputs do
    peaks = _peaks(project, "float16")
    assert "" not in peaks
    assert {"body", "body.0", "body.2"} <= set(peaks)  # float16 under autocast
    assert all(g is None or g < 65504 for _, g in peaks.values()), peaks


def test_a_float32_run_measures_every_tensor_as_a_forecast_for_float16(project):
    assert {"", "body", "body.0", "body.2"} <= set(_peaks(project, "float32"))


def test_the_module_whose_output_overflowed_is_named_where_its_finite_peak_is_nothing(project):
    peaks = {h.module: h for h in _probe(project, "float16", "Overflows", OVERFLOWS).peaks()}
    assert peaks["l2"].activation_absmax == 0.0  # all inf: no finite value to peak
    assert peaks["l2"].nonfinite_step == peaks["l3"].nonfinite_step == 0
    assert peaks["l1"].nonfinite_step is None
    # l3 only received the inf: the first module, in the forward's order, is where it began
    broke = went_nonfinite_in(list(peaks.values()), 0)
    assert broke is not None and broke.module == "l2"
    assert went_nonfinite_in(list(peaks.values()), 1) is None  # already non-finite before


def test_a_healthy_run_has_no_non_finite_step(project):
    assert all(h.nonfinite_step is None for h in _probe(project, "float16").peaks())
