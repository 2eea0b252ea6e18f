"""log-of-zero: `torch.log(1 - sigmoid(z))`, one half of a hand-written cross-entropy.

A sigmoid rounds to exactly 1 once z passes ~8.3 in float16, ~6.2 in bfloat16 and ~16.6
even in float32: one minus it is 0, and its log -inf. Found through variables, views and
methods as log-of-softmax finds a sigmoid; `1 - p + eps`, a clamp and `F.logsigmoid(-z)`
are not flagged (the epsilon's own size is eps-underflow's business). Other logs of
values that may be 0 (a ReLU's, a mask's) are left to `diagnose`, which sees the zero.
"""

from __future__ import annotations

from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity, pointer
from nandoctor.lint.flow import flow_of
from nandoctor.lint.source import Source
from nandoctor.lint.tags import Kind
from nandoctor.lint.unit import Check, Spot

INVALID = (
    """\
import torch
p = torch.sigmoid(logits)
loss = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
""",
    """\
import torch
not_p = 1.0 - logits.sigmoid()
log_not_p = not_p.log()
""",
)

VALID = (
    """\
import torch.nn.functional as F
loss = F.binary_cross_entropy_with_logits(logits, y)
log_not_p = F.logsigmoid(-logits)
""",
    """\
import torch
p = torch.sigmoid(logits)
safe = torch.log((1 - p).clamp_min(1e-4))
""",
)


def log_of_zero(src: Source) -> Iterator[Spot]:
    for call, argument in patterns.logs(src):
        complement = flow_of(src).of_kind(argument, Kind.COMPLEMENT)
        if complement:
            origin = complement[0].origin
            where = pointer(argument, origin)
            yield Spot(
                call,
                f"Use `F.logsigmoid(-z)` (or `F.binary_cross_entropy_with_logits` on the logits) "
                f"instead of `{patterns.log_name(src, call)}` of one minus a sigmoid{where}: the "
                f"sigmoid rounds to exactly 1 from z ~ 8.3 in float16 (6.2 in bfloat16, 16.6 in "
                f"float32), and log(1 - 1) = -inf gives a NaN gradient.",
            )


CHECK = Check(
    id="log-of-zero",
    run=log_of_zero,
    severity=Severity.ERROR,
    summary="`log` taken of one minus a sigmoid (directly or through a variable).",
    invalid=INVALID,
    valid=VALID,
)
