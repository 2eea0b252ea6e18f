"""eps-underflow: an epsilon that float16 rounds to 0, in a file that uses float16.

Three spellings, all warnings:
- an `eps` below 2**-24 ~ 6e-8 passed to a torch norm layer or optimizer (`LayerNorm`,
  `BatchNorm*`, `GroupNorm`, `Adam*`, `F.layer_norm`...) when the file casts to float16
  itself (`.half()`, `.to(torch.float16)`): under autocast alone these run in float32;
- `model.half()` with an Adam-family optimizer on its parameters and the default
  `eps=1e-8`: float16 optimizer state;
- such an epsilon added to a denominator or under a sqrt/log (`x / (n + 1e-8)`,
  `torch.rsqrt(var + 1e-12)`) in training code (a forward, a loss, and what they call)
  when the file uses float16 at all, autocast included, unless the code computes that
  term in float32 itself (`x.float().pow(2).mean(-1) + 1e-8`, as LLaMA's RMSNorm does).
  `log(softmax(x) + 1e-8)` is log-of-softmax's finding (its message names the epsilon).
"""

from __future__ import annotations

import ast
import struct
from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity
from nandoctor.lint.flow import flow_of
from nandoctor.lint.fp16 import Float16Use, float16_use
from nandoctor.lint.grad import on_differentiated_path
from nandoctor.lint.source import Source
from nandoctor.lint.tags import Kind
from nandoctor.lint.unit import Check, Spot

FLOAT16_SMALLEST = 2.0**-24  # float16's smallest subnormal, ~5.96e-8
_NN = "torch.nn."
_F = "torch.nn.functional."
# NB: the position of `eps` when passed positionally.
EPS_POSITION = {
    **{f"{_NN}{n}": 1 for n in ("LayerNorm", "RMSNorm", "LocalResponseNorm")},
    **{f"{_NN}{n}{d}d": 1 for n in ("BatchNorm", "InstanceNorm", "LazyBatchNorm") for d in "123"},
    f"{_NN}GroupNorm": 2,
    f"{_NN}SyncBatchNorm": 1,
    f"{_F}layer_norm": 4,
    f"{_F}group_norm": 4,
    f"{_F}batch_norm": 7,
    f"{_F}instance_norm": 7,
    f"{_F}normalize": 3,
    f"{_F}rms_norm": 3,
    **{f"torch.optim.{n}": 3 for n in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop")},
    "torch.optim.Adadelta": 3,
    "torch.optim.Adagrad": 5,
}
GUARDED = ("sqrt", "rsqrt", "log", "log2", "log10", "reciprocal")

INVALID = (
    """\
import torch
model = Net().cuda().half()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
""",
    """\
import torch.nn as nn
model = nn.Sequential(nn.Linear(512, 512), nn.LayerNorm(512, eps=1e-12)).half()
""",
    """\
import torch
class Scale(torch.nn.Module):
    def forward(self, x):
        return x / (x.abs().amax(-1, keepdim=True) + 1e-8)  # amax stays float16
with torch.autocast("cuda", dtype=torch.float16):
    y = Scale()(x)
""",
)

VALID = (
    """\
import torch
model = Net().cuda()  # float32 weights and Adam state; autocast does the float16 math
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
""",
    """\
import torch
model = Net().cuda().half()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
""",
    """\
import torch
y = x / (x.norm(dim=-1, keepdim=True) + 1e-8)  # float32 only: 1e-8 is representable
""",
)


def eps_underflow(src: Source) -> Iterator[Spot]:
    use = float16_use(src)
    if not use.any:
        return
    for call in src.calls:
        yield from _argument(src, call, use)
    yield from _denominators(src)


def _argument(src: Source, call: ast.Call, use: Float16Use) -> Iterator[Spot]:
    name = src.qualname(call.func)
    if name not in EPS_POSITION or not use.casts:
        return
    eps = patterns.arg(call, EPS_POSITION[name], "eps")
    value = flow_of(src).const(eps)
    short = name.rsplit(".", 1)[-1]
    if eps is not None and value is not None and 0 < value < FLOAT16_SMALLEST:
        yield Spot(eps, _eps_message(f"`{short}(eps={value:g})`", value))
    elif eps is None and name in patterns.ADAM and use.half_parameters(src, call):
        yield Spot(call, _adam_message(short))


def _denominators(src: Source) -> Iterator[Spot]:
    seen: set[int] = set()
    for node in src.nodes_of(ast.BinOp, ast.AugAssign, ast.Call):
        for guarded in _guarded_expressions(src, node):
            for tag in flow_of(src).of_kind(guarded, Kind.EPS_ADDED):
                value = tag.value or 0.0
                if not 0 < value < FLOAT16_SMALLEST or id(tag.origin) in seen:
                    continue
                seen.add(id(tag.origin))
                if not on_differentiated_path(src, tag.origin):
                    continue  # NB: data pipelines and metrics run in float32 (or numpy)
                if _log_of_padded_softmax(src, node, tag.origin):
                    continue  # NB: log-of-softmax warns there, the epsilon's size included
                if not _computed_in_float32(src, tag.origin):
                    yield Spot(tag.origin, _eps_message(f"`{value:g}` here", value))


def _log_of_padded_softmax(src: Source, node: ast.AST, addition: ast.AST) -> bool:
    """`log(softmax(x) + 1e-8)`: one finding there, log-of-softmax's, not a second."""
    is_log = isinstance(node, ast.Call) and patterns.log_input(src, node) is not None
    return is_log and flow_of(src).has(addition, Kind.SOFTMAX_EPS)


def _computed_in_float32(src: Source, addition: ast.AST) -> bool:
    """`x.float().norm() + 1e-8` is float32, even under autocast: 1e-8 survives there.
    NB: which ops autocast itself runs in float32 differs between CPU and CUDA (pow, sum
    and norm are float32 on CUDA, not on the CPU), so only explicit casts count."""
    if not isinstance(addition, ast.BinOp):
        return False
    return any(flow_of(src).has(side, Kind.FLOAT32) for side in (addition.left, addition.right))


def _guarded_expressions(src: Source, node: ast.AST) -> list[ast.AST | None]:
    """Denominators and the arguments of sqrt/log/reciprocal: where an eps must hold."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return [node.right]
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
        return [node.value]
    if not isinstance(node, ast.Call):
        return []
    name = src.qualname(node.func) or ""
    if name.startswith("torch.") and name.rsplit(".", 1)[-1] in GUARDED:
        return [patterns.first_arg(node)]
    receiver = patterns.method_receiver(src, node, frozenset(GUARDED))
    if receiver is not None and not node.args:
        return [receiver]
    if name in ("torch.div", "torch.true_divide") or patterns.method_receiver(
        src, node, frozenset({"div", "div_", "true_divide"})
    ):
        return [patterns.arg(node, 1 if name else 0, "other")]
    return []


def _eps_message(what: str, value: float) -> str:
    half = struct.unpack("e", struct.pack("e", value))[0]
    became = "exactly 0" if half == 0 else f"{half:.3g}, a subnormal that kernels may flush to 0"
    return (
        f"Use an epsilon float16 can hold (1e-5 or more): {what} is {became} in float16, "
        f"below its smallest value 2**-24 ~ 6e-8, so it no longer guards anything."
    )


def _adam_message(optimizer: str) -> str:
    return (
        f"Keep the weights in float32 (autocast + GradScaler) instead of `.half()` for "
        f"`{optimizer}`: its default eps=1e-8 is 0 in float16 and `exp_avg_sq` underflows "
        f"for gradients below ~5e-3, so the update divides by zero."
    )


CHECK = Check(
    id="eps-underflow",
    run=eps_underflow,
    severity=Severity.WARNING,
    summary="An epsilon below float16's smallest value (~6e-8) in a file that uses float16, "
    "or `model.half()` with Adam.",
    invalid=INVALID,
    valid=VALID,
)
