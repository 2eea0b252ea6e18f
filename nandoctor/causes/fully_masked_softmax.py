"""fully-masked-softmax: a softmax over a row that is entirely -inf (every position masked).

The rule wants the op to have made the NaN from -inf inputs; the what-if replays the run
with masks filled with the dtype's finite minimum by the math patch.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import CauseUnit, Fix, Hit, entry
from nandoctor.causes.words import SOFTMAXES, plural, values, where

ID = "fully-masked-softmax"

INFO = entry(
    ID,
    title="softmax over a row that is entirely -inf",
    explanation="""
    softmax subtracts the row maximum before exp; when every entry of a row is -inf, the
    maximum is -inf and (-inf) - (-inf) is NaN, so the whole row is NaN in every dtype. It
    happens with padding masks when a sequence is all padding, or when a query may attend
    to nothing (an empty window, cross-attention over an empty memory). A causal mask never
    does it: each row keeps its diagonal.
    """,
    fix="""
    Fill masked positions with `torch.finfo(scores.dtype).min` instead of `float("-inf")`
    (with `masked_fill`, not by adding it): a fully masked row then becomes a uniform
    distribution that the loss can ignore, instead of a NaN that poisons the batch.
    """,
    before="""
    scores = scores.masked_fill(padding_mask, float("-inf"))
    attn = torch.softmax(scores, dim=-1)
    """,
    after="""
    scores = scores.masked_fill(padding_mask, torch.finfo(scores.dtype).min)
    attn = torch.softmax(scores, dim=-1)
    """,
)


def fully_masked_softmax(case: Case) -> Hit | None:
    if case.op not in SOFTMAXES | {"sub", "exp"} or not case.created_nan:
        return None
    masked = sum(i.neginf for i in case.evidence.inputs)
    if masked == 0:
        return None
    confidence = 0.92 if case.op in SOFTMAXES else 0.7
    sentence = (
        f"{case.first.op}{where(case)} received {plural(masked, '-inf value')} and made "
        f"{values(case.first.count_nonfinite, 'nan')}: a row that is entirely -inf gives "
        "exp(-inf)/sum = 0/0"
    )
    return Hit(confidence, [sentence])


FIXES = (Fix(patch=True),)

CAUSE = CauseUnit(INFO, rule=fully_masked_softmax, fixes=FIXES)
