"""nonfinite-input: the batch itself held NaN or inf before any op ran.

Named by the phase alone. The what-if replays the run with such batches skipped.
"""

from __future__ import annotations

import math

from nandoctor.causes.case import Case
from nandoctor.causes.unit import CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import values

ID = "nonfinite-input"

INFO = entry(
    ID,
    title="the batch itself held NaN or inf",
    explanation="""
    NaN propagates through every op it touches: one NaN pixel or label makes the loss NaN
    and, after the backward, the gradient of every weight. The usual sources are in the
    data pipeline: a per-sample normalisation dividing by a zero standard deviation, a log
    of 0 in feature engineering, missing values read as NaN from CSV or Parquet, a corrupt
    image. The model did nothing wrong; the fix belongs in the data. (Labels missing on
    purpose, stored as NaN and masked in the loss by indexing, are not this: their values
    never reach the loss, so the run is healthy; masked with `torch.where`, they reach the
    gradients all the same, the loss finite, as the backward multiplies the masked branch's
    gradient, 0, by them: index them away. Nor is an additive attention mask of 0 and -inf
    carried in the batch: its -inf are deliberate, and a row it masks entirely is
    fully-masked-softmax. A tensor of 0 and -inf that a layer multiplies, as `log` of a
    0/1 feature, is data again: this cause.)
    """,
    fix="""
    Find and repair the bad samples (check `torch.isfinite(x).all()` per sample in the
    dataset; `torch.nan_to_num` only as a stopgap): a model cannot learn from NaN, and one
    NaN sample poisons the gradients of the whole batch.
    """,
    before="""
    def __getitem__(self, i):
        x = self.features[i]
        return (x - x.mean()) / x.std(), self.labels[i]
    """,
    after="""
    def __getitem__(self, i):
        x = self.features[i]
        x = (x - x.mean()) / x.std().clamp_min(1e-6)  # constant rows have std 0
        assert torch.isfinite(x).all(), f"sample {i} is not finite"
        return x, self.labels[i]
    """,
)


def nonfinite_input(case: Case) -> Hit | None:
    f = case.first
    if f.phase != "input":
        return None
    tensor = f" in {f.tensor}" if f.tensor else ""
    form = f" ({f.dtype} {f.shape})" if f.dtype and f.shape is not None else ""
    held = values(f.count_nonfinite, f.value)
    sentence = f"the batch of step {f.step} held {held}{tensor}{form} before any op ran"
    loss = case.failing_loss
    if loss is None or not math.isfinite(loss):
        return Hit(0.99, [sentence])
    # NB: its values never reached the loss, yet the gradients: values masked with a
    # `torch.where` (or times a 0 mask), whose backward still multiplies by them
    reached = (
        f"the loss of step {f.step} was finite ({loss:.4g}): the batch's non-finite values "
        "reached the gradients only, as values masked with `torch.where` (or multiplied by "
        "a 0 mask) do: the backward multiplies the masked branch's gradient, 0, by them"
    )
    return Hit(0.99, [sentence, reached], fix=_MASKED_FIX)


_MASKED_FIX = (
    "Mask missing values by indexing (`((pred - y)[known] ** 2).mean()`), or replace them "
    "before the mask (`y = torch.nan_to_num(y)`): a `torch.where` keeps both branches in "
    "the backward, and 0 * NaN is NaN. If the values are not missing on purpose, repair the "
    "samples that hold them."
)


FIXES = (Fix(change=Change.SKIP_NONFINITE_BATCHES),)

CAUSE = CauseUnit(INFO, rule=nonfinite_input, fixes=FIXES)
