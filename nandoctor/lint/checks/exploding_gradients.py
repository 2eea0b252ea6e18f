"""exploding-gradients: a GradScaler loop that never clips the gradients.

Lower severity than clip-before-unscale: many runs train fine unclipped, but nothing bounds
an update when one batch's gradient blows up. The check stays silent when the file clips
anywhere (any call or keyword named like `clip`, gradient hooks), so clipping in a helper,
a library wrapper (`loss_scaler(..., clip_grad=1.0)`) or another branch is trusted. One
finding per file, at the first `scaler.step(opt)`: one loop, one missing clip.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from nandoctor.lint.findings import Severity
from nandoctor.lint.registry import Hit, check
from nandoctor.lint.scaler import scaler_uses
from nandoctor.lint.source import Source, position

INVALID = (
    """\
import torch
scaler = torch.cuda.amp.GradScaler()
for x, y in loader:
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
""",
)

VALID = (
    """\
import torch
scaler.scale(loss).backward()
scaler.unscale_(opt)
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
scaler.step(opt)
scaler.update()
""",
    """\
import torch
loss_scaler(loss, optimizer, clip_grad=1.0, parameters=model.parameters())  # timm
""",
)


@check(
    "exploding-gradients",
    severity=Severity.WARNING,
    summary="A GradScaler loop (`scaler.scale(loss).backward()`) with no gradient clipping "
    "anywhere in the file.",
    invalid=INVALID,
    valid=VALID,
)
def exploding_gradients(src: Source) -> Iterator[Hit]:
    uses = scaler_uses(src)
    if not uses or _clips_somewhere(src):
        return
    steps = [s for use in uses for s in use.steps]
    anchor = min(steps or [s for use in uses for s in use.scales], key=position)
    yield Hit(anchor, _message(anchor))  # NB: once per file: one loop, one missing clip


def _clips_somewhere(src: Source) -> bool:
    for call in src.calls:
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if "clip" in name.lower() or name == "register_hook":
            return True
        if any(k.arg and "clip" in k.arg.lower() for k in call.keywords):
            return True
    return False


def _message(anchor: ast.Call) -> str:
    scaler = ast.unparse(anchor.func.value)  # type: ignore[attr-defined]
    is_step = isinstance(anchor.func, ast.Attribute) and anchor.func.attr == "step"
    opt = ast.unparse(anchor.args[0]) if is_step and anchor.args else "opt"
    return (
        f"Clip the gradients: call `{scaler}.unscale_({opt})` and "
        f"`torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)` before "
        f"`{scaler}.step({opt})`, or one bad batch can grow them until they overflow "
        f"(65504 in float16)."
    )
