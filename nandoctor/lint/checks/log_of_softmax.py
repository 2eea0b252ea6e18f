"""log-of-softmax: `torch.log` of a softmax output, or of a sigmoid's, in every spelling.

Found through aliases and methods (`F.softmax`, `x.softmax(-1).log()`, an `nn.Softmax` or
`nn.Sigmoid` module, one ending an `nn.Sequential`), through variables in the same
function (`probs = softmax(...)` then `log(probs)`), and through views and gathers
(`probs.gather(1, y)`). `log(probs + 1e-8)` is a warning: the epsilon hides the zero in
float32 only, and `1e-8` is 0 in float16. A sigmoid's probability fails the same way
(`log(1 - sigmoid(z))`, the other half of a hand-written binary cross-entropy, is
log-of-zero's: the zero is the subtraction's). `F.log_softmax`, `F.logsigmoid`, a clamped
probability and a user's own `log` are not flagged.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity, pointer
from nandoctor.lint.flow import flow_of
from nandoctor.lint.source import Source
from nandoctor.lint.tags import Kind, Tag
from nandoctor.lint.unit import Check, Spot

INVALID = (
    """\
import torch
loss = -(y * torch.log(torch.softmax(logits, -1))).sum(-1).mean()
""",
    """\
import torch.nn.functional as F
from torch import log
probs = F.softmax(logits, dim=-1)
nll = -log(probs.gather(1, y[:, None])).mean()
""",
    """\
import torch
log_probs = logits.softmax(-1).log()
""",
    """\
import torch
probs = torch.softmax(logits, -1)
loss = -(y * torch.log(probs + 1e-8)).sum(-1).mean()  # warning: hides the 0 in float32 only
""",
    """\
import torch
p = torch.sigmoid(logits)
loss = -(y * torch.log(p)).mean()
""",
)

VALID = (
    """\
import torch.nn.functional as F
loss = F.cross_entropy(logits, y)
log_probs = F.log_softmax(logits, dim=-1)
""",
    """\
import torch.nn.functional as F
loss = F.binary_cross_entropy_with_logits(logits, y)
log_p, log_not_p = F.logsigmoid(logits), F.logsigmoid(-logits)
""",
    """\
import math
import numpy as np
from scipy.special import softmax
h = math.log(2) + np.log(softmax(scores)).sum()  # not torch
""",
)


def log_of_softmax(src: Source) -> Iterator[Spot]:
    for call, argument in patterns.logs(src):
        tags = flow_of(src).tags(argument)
        softmax = [t for t in tags if t.kind is Kind.SOFTMAX]
        padded = [t for t in tags if t.kind is Kind.SOFTMAX_EPS]
        sigmoid = [t for t in tags if t.kind is Kind.SIGMOID]
        if softmax:
            yield Spot(call, _direct(src, call, argument, softmax[0]))
        elif padded:
            yield Spot(call, _padded(src, call, padded[0]), Severity.WARNING)
        elif sigmoid:
            yield Spot(call, _sigmoid(src, call, argument, sigmoid[0]))


def _direct(src: Source, call: ast.Call, argument: ast.AST, tag: Tag) -> str:
    where = pointer(argument, tag.origin)
    return (
        f"Use `F.log_softmax` (or `F.cross_entropy` on the logits) instead of "
        f"`{patterns.log_name(src, call)}` of a softmax{where}: a probability that underflowed "
        f"to 0 gives log(0) = -inf and a NaN gradient."
    )


def _sigmoid(src: Source, call: ast.Call, argument: ast.AST, tag: Tag) -> str:
    where = pointer(argument, tag.origin)
    return (
        f"Use `F.logsigmoid(z)` (or `F.binary_cross_entropy_with_logits` on the logits) "
        f"instead of `{patterns.log_name(src, call)}` of a sigmoid{where}: the sigmoid rounds "
        f"to exactly 0 below z ~ -17.3 in float16 (-88.7 in bfloat16 and float32), and "
        f"log(0) = -inf gives a NaN gradient."
    )


def _padded(src: Source, call: ast.Call, tag: Tag) -> str:
    eps = f"{tag.value:g}" if tag.value is not None else "an epsilon"
    in_half = " (it is 0 in float16)" if tag.value is not None and tag.value < 2**-24 else ""
    return (
        f"Use `F.log_softmax` instead of `{patterns.log_name(src, call)}` of a softmax plus {eps}"
        f"{in_half}: the epsilon hides the underflow only where the dtype can hold it, and "
        f"it biases the log-probabilities."
    )


CHECK = Check(
    id="log-of-softmax",
    run=log_of_softmax,
    severity=Severity.ERROR,
    summary=(
        "`log` taken of a softmax or sigmoid output (directly, through a variable, or a "
        "softmax with `+ eps`)."
    ),
    invalid=INVALID,
    valid=VALID,
)
