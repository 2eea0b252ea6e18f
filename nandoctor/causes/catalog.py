"""The cause catalog: each cause id of SPEC.md, written once, read by everyone.

Diagnosis rules, `nandoctor lint` and docs/causes.md all take a cause's title,
explanation, fix and before/after snippets from here, so the words a user reads in a
report, in a lint finding and in the docs are the same words. For example::

    >>> get("eps-underflow").title
    'an epsilon that is 0 in float16'

Ids are stable: add new ones, never rename (SPEC.md, "Cause ids"). The explanations quote
the numbers a practitioner can check: float16 tops out at 65504, its smallest positive
value (a subnormal) is 2**-24 ~ 6e-8, so exp(-18) and 1e-8 are exactly 0 there.
Nothing here imports torch.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

__all__ = ["CATALOG", "CauseInfo", "get"]


@dataclass(frozen=True)
class CauseInfo:
    """One cause: what it is, why it produces non-finite values, and what to do instead.

    `fix` gives the remedy and the reason in one sentence; `before` and `after` are small,
    realistic snippets (they parse, though they use names such as `model` they don't define).
    """

    id: str
    title: str
    explanation: str
    fix: str
    before: str
    after: str


CATALOG: dict[str, CauseInfo] = {}


def get(cause_id: str) -> CauseInfo:
    """The catalog entry of `cause_id`; a KeyError names the known ids."""
    try:
        return CATALOG[cause_id]
    except KeyError:
        raise KeyError(f"unknown cause id {cause_id!r}; known: {', '.join(CATALOG)}") from None


def _cause(id: str, title: str, explanation: str, fix: str, before: str, after: str) -> None:
    """Register one entry. NB: a duplicate id is a programming error, refused at import."""
    if id in CATALOG:
        raise ValueError(f"cause id {id!r} is registered twice")
    CATALOG[id] = CauseInfo(
        id=id,
        title=title,
        explanation=" ".join(explanation.split()),
        fix=" ".join(fix.split()),
        before=textwrap.dedent(before).strip("\n"),
        after=textwrap.dedent(after).strip("\n"),
    )


_cause(
    "log-of-softmax",
    "log of a softmax that underflowed to 0",
    """
    A softmax probability rounds to exactly 0 once its logit trails the largest one by more
    than ~17.3 in float16 (exp(-18) ~ 1.5e-8 is below the smallest float16 value, 6e-8) or
    ~104 in float32. log(0) is -inf; times a zero target it is NaN, and the backward of log
    divides by that 0. `log_softmax` computes `x - logsumexp(x)` directly, so it never forms
    the 0: a logit 1000 below the top just gives a log-probability of -1000.
    """,
    """
    Use `F.cross_entropy(logits, target)`, or `F.log_softmax(logits, dim=-1)` where you need
    the log-probabilities: they compute `x - logsumexp(x)` and never take the log of a
    probability that underflowed to 0.
    """,
    """
    probs = torch.softmax(logits, dim=-1)
    loss = -(target * torch.log(probs)).sum(-1).mean()
    """,
    """
    loss = F.cross_entropy(logits, target)  # class indices or probabilities
    # or, when you need the log-probabilities themselves:
    log_probs = F.log_softmax(logits, dim=-1)
    loss = -(target * log_probs).sum(-1).mean()
    """,
)

_cause(
    "log-of-zero",
    "log, reciprocal or division meeting an exact zero",
    """
    log(0) is -inf and 1/0 is inf in every dtype, and the backward of log(x) is 1/x, so even
    a loss that stays finite can send an inf gradient. The zeros come from ReLU outputs,
    sigmoid(x) for x below about -17 in float16 (-104 in float32), empty masks and padding.
    An epsilon helps only if the dtype can hold it: `1e-8` is exactly 0 in float16.
    """,
    """
    Stay in log space with the fused op (`F.binary_cross_entropy_with_logits`,
    `F.logsigmoid`, `torch.log1p`, `torch.xlogy`) or clamp the argument with
    `clamp_min(torch.finfo(x.dtype).tiny)`: the log then stays finite and its gradient bounded.
    """,
    """
    p = torch.sigmoid(z)
    loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    """,
    """
    loss = F.binary_cross_entropy_with_logits(z, y)
    """,
)

_cause(
    "fp16-overflow",
    "a finite value exceeded float16's range (65504)",
    """
    float16 has 5 exponent bits: its largest finite value is 65504, and anything larger
    becomes inf, which the next op turns into NaN (inf - inf, 0 * inf). Values that are
    harmless in float32 overflow there: attention logits of 12 fed to exp (e^12 ~ 163000),
    a sum of 4096 activations of 20, the square of 300. bfloat16 spends the same 16 bits
    differently: float32's 8 exponent bits, so its range reaches ~3.4e38, paid for with
    precision: 8 significand bits (2-3 decimal digits) against float16's 11.
    """,
    """
    Train in bfloat16 (`torch.autocast(device, dtype=torch.bfloat16)`, no GradScaler
    needed): its 8 exponent bits reach ~3.4e38 instead of 65504. Where float16 must stay,
    keep the overflowing op in float32 and scale values down before it.
    """,
    """
    scaler = torch.cuda.amp.GradScaler()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    """,
    """
    with torch.autocast("cuda", dtype=torch.bfloat16):  # range ~3.4e38, no loss scaling
        loss = model(x, y)
    loss.backward()
    """,
)

_cause(
    "exploding-gradients",
    "gradient norm grew until it overflowed",
    """
    Without clipping, one bad batch or a sharp region of the loss multiplies the gradient
    norm step after step; once a gradient passes 65504 in float16 (3.4e38 in float32) it is
    inf, and the update writes NaN into the weights. With a GradScaler the gradients are
    still multiplied by the loss scale (65536 at the start) until `scaler.unscale_(opt)`, so
    the clipping must come after it to compare the threshold with the true norm.
    """,
    """
    Clip the gradient norm every step, after `scaler.unscale_(opt)` when a GradScaler is
    used (`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`): the clip bounds each
    update however large one batch's gradient is.
    """,
    """
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    """,
    """
    scaler.scale(loss).backward()
    scaler.unscale_(opt)  # gradients back to their true size
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    scaler.step(opt)  # still skips the step if the gradients hold inf or NaN
    scaler.update()
    """,
)

_cause(
    "learning-rate-too-high",
    "updates too large for the weights",
    """
    When each update is a sizeable fraction of the weight it changes (an update-to-weight
    ratio above ~1e-2 per step, where ~1e-3 is healthy), the loss climbs instead of falling,
    weights and activations grow, and the first op that leaves the dtype's range produces
    inf. The failing step is only where the divergence became visible: the loss curve rises
    tens or hundreds of steps before it.
    """,
    """
    Lower the learning rate (10x smaller is a good first test) or warm it up over the first
    steps: smaller updates keep the update-to-weight ratio near 1e-3, where training
    converges instead of diverging.
    """,
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    """,
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, total_iters=1000)
    """,
)

_cause(
    "nonfinite-input",
    "the batch itself held NaN or inf",
    """
    NaN propagates through every op it touches: one NaN pixel or label makes the loss NaN
    and, after the backward, the gradient of every weight. The usual sources are in the
    data pipeline: a per-sample normalisation dividing by a zero standard deviation, a log
    of 0 in feature engineering, missing values read as NaN from CSV or Parquet, a corrupt
    image. The model did nothing wrong; the fix belongs in the data.
    """,
    """
    Find and repair the bad samples (check `torch.isfinite(x).all()` per sample in the
    dataset; `torch.nan_to_num` only as a stopgap): a model cannot learn from NaN, and one
    NaN sample poisons the gradients of the whole batch.
    """,
    """
    def __getitem__(self, i):
        x = self.features[i]
        return (x - x.mean()) / x.std(), self.labels[i]
    """,
    """
    def __getitem__(self, i):
        x = self.features[i]
        x = (x - x.mean()) / x.std().clamp_min(1e-6)  # constant rows have std 0
        assert torch.isfinite(x).all(), f"sample {i} is not finite"
        return x, self.labels[i]
    """,
)

_cause(
    "nonfinite-parameters",
    "parameters were non-finite before the step",
    """
    Weights that are NaN before the forward pass mean the failure happened earlier: a
    checkpoint saved after a silent corruption, an optimizer step that wrote NaN when
    nothing checked, an initialisation that divided by zero. Every step from then on is
    NaN, so the step where it is noticed says nothing about the cause; a NaN weight never
    recovers by more training.
    """,
    """
    Resume from the last checkpoint whose weights are finite, and check
    `torch.isfinite(p).all()` for every parameter before saving: a checkpoint is then known
    good, and the next failure shows up at the step that caused it.
    """,
    """
    torch.save(model.state_dict(), "last.pt")
    """,
    """
    if all(torch.isfinite(p).all() for p in model.parameters()):
        torch.save(model.state_dict(), "last.pt")
    else:
        raise RuntimeError(f"non-finite weights at step {step}; keeping the previous checkpoint")
    """,
)

_cause(
    "division-by-zero",
    "0/0 or x/0 in user math",
    """
    `x / x.sum()` or `x / x.norm()` is inf (x/0) or NaN (0/0) as soon as the denominator is
    exactly 0: an all-zero row, an empty mask, a batch in which every label is ignored. The
    backward is worse than the forward: d(a/b)/db = -a/b**2 overflows float16 already for
    b = 1e-3 and a = 0.1 (1e5 > 65504).
    """,
    """
    Bound the denominator with an epsilon the dtype can hold or a clamp
    (`mask.sum().clamp_min(1)`, `x.norm(dim=-1, keepdim=True).clamp_min(1e-6)`, or
    `F.normalize(x, dim=-1)`): a bounded denominator bounds both the value and its gradient.
    """,
    """
    loss = (per_token * mask).sum() / mask.sum()
    unit = x / x.norm(dim=-1, keepdim=True)
    """,
    """
    loss = (per_token * mask).sum() / mask.sum().clamp_min(1)
    unit = F.normalize(x, dim=-1)  # divides by max(norm, 1e-12)
    """,
)

_cause(
    "nondifferentiable-point",
    "a backward at a point of infinite derivative",
    """
    d sqrt(x)/dx = 1/(2 sqrt(x)) is inf at x = 0, and the chain rule multiplies it by the 0
    gradient of the squares inside: inf * 0 = NaN. So `torch.sqrt(((a - b) ** 2).sum(-1))`
    has a fine forward value (0) and NaN gradients for identical points. acos and asin have
    infinite derivatives at +-1, pow(x, p) with p < 1 at 0. `torch.linalg.vector_norm`
    defines a zero gradient at 0 and is safe.
    """,
    """
    Keep the argument off the singular point (`torch.sqrt(x + 1e-6)`,
    `torch.acos(c.clamp(-1 + 1e-6, 1 - 1e-6))`) or use `torch.linalg.vector_norm`: the
    backward then never multiplies an infinite derivative by 0.
    """,
    """
    dist = torch.sqrt(((a - b) ** 2).sum(-1))
    angle = torch.acos(F.cosine_similarity(u, v))
    """,
    """
    dist = torch.linalg.vector_norm(a - b, dim=-1)  # gradient 0 at 0, not NaN
    angle = torch.acos(F.cosine_similarity(u, v).clamp(-1 + 1e-6, 1 - 1e-6))
    """,
)

_cause(
    "fully-masked-softmax",
    "softmax over a row that is entirely -inf",
    """
    softmax subtracts the row maximum before exp; when every entry of a row is -inf, the
    maximum is -inf and (-inf) - (-inf) is NaN, so the whole row is NaN in every dtype. It
    happens with padding masks when a sequence is all padding, or when a query may attend
    to nothing (an empty window, cross-attention over an empty memory). A causal mask never
    does it: each row keeps its diagonal.
    """,
    """
    Fill masked positions with `torch.finfo(scores.dtype).min` instead of `float("-inf")`
    (with `masked_fill`, not by adding it): a fully masked row then becomes a uniform
    distribution that the loss can ignore, instead of a NaN that poisons the batch.
    """,
    """
    scores = scores.masked_fill(padding_mask, float("-inf"))
    attn = torch.softmax(scores, dim=-1)
    """,
    """
    scores = scores.masked_fill(padding_mask, torch.finfo(scores.dtype).min)
    attn = torch.softmax(scores, dim=-1)
    """,
)

_cause(
    "eps-underflow",
    "an epsilon that is 0 in float16",
    """
    float16's smallest positive value is 2**-24 ~ 6e-8 (a subnormal), so the `1e-8` that
    guards a denominator in float32 rounds to exactly 0 in float16, and
    `x / (norm + 1e-8)` is x/0 again. Adam's default `eps=1e-8` meets the same fate when
    the parameters and optimizer state are float16 (`model.half()`): `exp_avg_sq` also
    underflows to 0 for gradients below ~5e-3 (0.001 * g**2 < 3e-8), and the update
    divides by 0.
    """,
    """
    Use an epsilon the dtype can hold (1e-5 or more for float16, e.g.
    `torch.finfo(torch.float16).eps`) and keep weights and optimizer state in float32 with
    autocast + GradScaler instead of `model.half()`: the epsilon then guards the denominator
    instead of vanishing.
    """,
    """
    model = Net().cuda().half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8 is 0 in float16
    y = x / (x.norm(dim=-1, keepdim=True) + 1e-8)
    """,
    """
    model = Net().cuda()  # float32 weights and Adam state; autocast runs the math in float16
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    y = x / (x.norm(dim=-1, keepdim=True) + 1e-5)
    """,
)

_cause(
    "grad-scaler-collapse",
    "repeated overflow skips drove the loss scale toward 0",
    """
    GradScaler multiplies the loss by a scale (65536 at the start) so that small float16
    gradients do not underflow; on a step whose scaled gradients hold inf or NaN it skips
    the update and halves the scale. A few skips are normal; a streak means the gradients
    are non-finite at any scale (a NaN from the forward pass, or a real overflow): after 16
    skips the scale is 1, after 40 it is below 1e-7 and every gradient underflows to 0.
    """,
    """
    Fix what makes every step non-finite (`nandoctor diagnose` names the first op) instead
    of tuning the scaler, and switch to bfloat16 if the gradients truly overflow: skipping
    steps cannot repair a NaN that the forward pass produces every time.
    """,
    """
    scaler = torch.cuda.amp.GradScaler(init_scale=2.0**16)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    """,
    """
    with torch.autocast("cuda", dtype=torch.bfloat16):  # no loss scale to collapse
        loss = model(x, y)
    loss.backward()
    opt.step()
    """,
)

_cause(
    "invalid-domain",
    "log or sqrt of a negative number, acos outside [-1, 1]",
    """
    log and sqrt of a negative number and acos or asin of a value outside [-1, 1] are NaN in
    every dtype. The argument is meant to be in range and misses by a rounding error: a
    variance computed as `E[x**2] - E[x]**2` comes out as -1e-7, a cosine computed as the
    dot product of normalised vectors as 1.0000001.
    """,
    """
    Clamp into the domain before the op (`torch.sqrt(var.clamp_min(0))`,
    `torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6))`) or use the stable formula (`torch.var`,
    `F.cosine_similarity`): rounding can then no longer push the argument out of range.
    """,
    """
    var = (x**2).mean(-1) - x.mean(-1) ** 2
    std = torch.sqrt(var)
    """,
    """
    var = x.var(-1, unbiased=False)  # never negative
    std = torch.sqrt(var + 1e-5)
    """,
)

_cause(
    "clip-before-unscale",
    "gradients clipped while still scaled by the GradScaler",
    """
    Between `scaler.scale(loss).backward()` and `scaler.step(opt)` every gradient is
    multiplied by the loss scale (65536 at the start). `clip_grad_norm_(params, 1.0)` on
    them clips the scaled norm to 1.0, so after unscaling the update is ~65536 times
    smaller than intended, and the effective threshold changes every time the scale does.
    `scaler.unscale_(opt)` divides the gradients back first; `scaler.step` then does not
    divide them twice.
    """,
    """
    Call `scaler.unscale_(opt)` right before `clip_grad_norm_`: the threshold then applies
    to the true gradients, and `scaler.step(opt)` still skips the step if they hold inf or
    NaN.
    """,
    """
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    """,
    """
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    """,
)
