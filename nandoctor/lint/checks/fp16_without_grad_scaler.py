"""fp16-without-grad-scaler: training under float16 autocast with a plain `loss.backward()`.

Flagged: an autocast to float16 (`dtype=torch.float16` or `torch.half` through any alias, or
no dtype where float16 is the default: `torch.cuda.amp.autocast()`,
`torch.autocast("cuda")`, a device held in a variable) that training code enters, in a file
that calls `loss.backward()` (or `torch.autograd.backward(loss)`) itself and has no
GradScaler anywhere. Training means an optimizer step follows: `opt.step()` under any name
(`self.optimizer.step()`, `optimizers[0].step()`, `optimizer.step(closure)`), in the
function that backpropagates under the autocast or in its call chain (a helper it calls, the
loop that calls it, a method that loop calls, the optimizer a closure is handed to); for an
autocast whose backward is elsewhere (a decorated `forward`), anywhere in the file. The
finding is on the autocast call, once per region: float16 is chosen there, so both fixes
start on that line (a bfloat16 dtype, or a scaler around the backward the message names),
and a loop with several backwards (a GAN's two losses) gets one finding, not one per
backward. An autocast built once and entered later (`ctx = torch.autocast(...)`,
`ctx = nullcontext() if cpu else torch.autocast(...)`) is judged where a `with ctx:` enters
it, and a factory (timm's
`amp_autocast = partial(torch.autocast, device_type=..., dtype=...)`) where a
`with amp_autocast():` does. A dtype that is float16 only when a flag picks it (nanoGPT's
and llm.c's `ptdtype = {'float32': ..., 'bfloat16': ..., 'float16': torch.float16}[dtype]`,
`torch.float16 if args.fp16 else torch.bfloat16`, through a variable) is flagged too, with a
message that says so: the scaler is needed on that choice, which
`GradScaler(enabled=(dtype == 'float16'))` gives. A GradScaler built with a literal
`enabled=False` is no scaler: when every one the file builds is so,
`scaler.scale(loss).backward()` is a plain backward and `scaler.step(opt)` a plain step, and
the message asks to enable it.

Not flagged: a backward that no optimizer step follows (a model test that backpropagates
under float16 to assert on `.grad`, as diffusers' and transformers' tests do, even beside
another test of the file that steps an optimizer; the `step()` of an LR scheduler, the
profiler, an EMA, early stopping or a diffusion scheduler is no optimizer step); a file that
uses a GradScaler in any form (`torch.amp.GradScaler`, `torch.cuda.amp.GradScaler`, FSDP's
`ShardedGradScaler`, a `scaler` passed in and used as `scaler.scale(loss)`, timm's
`loss_scaler(...)`), including one that may be on (`GradScaler(enabled=use_amp)`, nanoGPT's
`enabled=(dtype == 'float16')`, a disabled one for the CPU beside it); a library that owns
the backward (`accelerator.backward(loss)`, `engine.backward(loss)`,
`fabric.backward(loss)`, `self.manual_backward(loss)`, a LightningModule's `training_step`,
apex's `amp.scale_loss`); a loss scaled by hand (`(loss * loss_scale).backward()`,
`(loss * 1024).backward()`, `scaled_loss.backward()`: the code says it scales, so it is
trusted to unscale and skip too); autocast under `torch.no_grad()` or
`torch.inference_mode()`, or in an evaluation function that never backpropagates
(`evaluate`, `validate`, `predict`...); the CPU's autocast (bfloat16 by default) and any
bfloat16 autocast; an autocast with `enabled=False`. A dtype held in a variable whose value
the file does not show (`dtype=amp_dtype` from a config or a parameter) is not guessed. Only
this file is read: an autocast in `model.py` and the backward in `train.py` are not
connected.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from nandoctor.lint import patterns
from nandoctor.lint.findings import Severity, from_line
from nandoctor.lint.flow import flow_of
from nandoctor.lint.fp16 import autocast_call, float16_autocast, float16_chosen
from nandoctor.lint.grad import call_chain, differentiated
from nandoctor.lint.scaler import is_scale, scaler_uses
from nandoctor.lint.source import Source, position
from nandoctor.lint.unit import Check, Spot

SCALERS = patterns.GRAD_SCALERS | {
    "torch.distributed.fsdp.ShardedGradScaler",
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler",
}
# NB: identifiers of a loss scaler (timm's NativeScaler, `loss_scaler`, `self.grad_scaler`),
# not sklearn's StandardScaler.
SCALER_NAME = re.compile(r"(grad|loss|amp|apex|native)_?scaler", re.IGNORECASE)
# what a decorator can be on
Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
# a library's own backward: the loss is its argument (`accelerator.backward(loss)`)
LIBRARY_BACKWARDS = frozenset({"manual_backward", "scale_loss"})
EVAL_WORDS = frozenset({
    "eval", "evaluate", "evaluation", "validate", "validation", "val", "valid", "test",
    "predict", "prediction", "inference", "infer", "generate", "sample", "score",
})  # fmt: skip

INVALID = (
    """\
import torch
for x, y in loader:
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
""",
    """\
from torch.cuda.amp import autocast
def train_step(model, opt, x, y):
    with autocast():  # float16 by default on CUDA
        loss = model(x, y)
    loss.backward()
    opt.step()
""",
    """\
import torch
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = torch.amp.autocast(device_type="cuda", dtype=ptdtype)  # float16 when dtype says so
with ctx:
    loss = model(x, y)
loss.backward()
opt.step()
""",
)

VALID = (
    """\
import torch
scaler = torch.amp.GradScaler("cuda")
for x, y in loader:
    opt.zero_grad()
    with torch.autocast("cuda", dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
""",
    """\
import torch
with torch.autocast("cuda", dtype=torch.bfloat16):  # float32's range: no scaler needed
    loss = loss_fn(model(x), y)
loss.backward()
opt.step()
""",
    """\
import torch
with torch.autocast("cuda", dtype=torch.float16):
    loss = loss_fn(model(x), y)
accelerator.backward(loss)  # Accelerate scales the loss itself
""",
    """\
import torch
loss = loss_fn(model(x), y)
loss.backward()
opt.step()
with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
    val_loss = loss_fn(model(x_val), y_val)  # evaluation: no gradients
""",
    """\
import torch
with torch.autocast("cuda", dtype=torch.float16):
    loss = model(x).sum()
loss.backward()  # a test of the gradients: no optimizer steps, nothing is trained
assert all(p.grad is not None for p in model.parameters())
""",
)


def fp16_without_grad_scaler(src: Source) -> Iterator[Spot]:
    backwards = [c for c in src.calls if _plain_backward(src, c)]
    if not backwards or _scales_elsewhere(src):
        return
    steps = [c for c in src.calls if patterns.is_optimizer_step(src, c)]
    for call in src.calls:
        autocast = autocast_call(src, call)
        if autocast is None or not float16_autocast(src, autocast):
            continue
        training = [
            site
            for site in _entered_at(src, call, factory=autocast is not call)
            if _trains(src, site) and _steps_after(src, site, backwards, steps)
        ]
        if training:
            backward = _backward_after(src, training[0], backwards)
            yield Spot(call, _message(src, autocast, backward))


def _plain_backward(src: Source, call: ast.Call) -> bool:
    """`loss.backward()` (keywords allowed) or `torch.autograd.backward(loss)`, on a loss
    that is not scaled: `accelerator.backward(loss)` takes the loss, `Tensor.backward` not."""
    if src.qualname(call.func) == "torch.autograd.backward":
        loss = patterns.first_arg(call, "tensors")
        return loss is not None and not _scaled_by_hand(src, loss)
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "backward") or call.args:
        return False
    loss = call.func.value
    if (isinstance(loss, ast.Name) and loss.id in ("self", "cls")) or src.qualname(loss):
        return False
    if isinstance(loss, ast.Call) and is_scale(src, loss):
        if _disabled_scaler(src) is None:
            return False  # scaler.scale(loss).backward()
        loss = loss.args[0]  # a disabled scaler returns the loss as it is
    return not _scaled_by_hand(src, loss)


def _scaled_by_hand(src: Source, loss: ast.expr) -> bool:
    """`(loss * loss_scale)`, `scaled_loss`, `(loss * 1024)`, or a name last assigned so
    (`loss = loss * 128`, `loss *= self.scale`) in the same function."""
    if "scale" in ast.unparse(loss).lower() or _times_big_constant(src, loss):
        return True
    if not isinstance(loss, ast.Name):
        return False
    function = src.function_of(loss)
    for node in src.nodes_of(ast.Assign, ast.AugAssign):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        named = any(isinstance(t, ast.Name) and t.id == loss.id for t in targets)
        if named and src.function_of(node) is function and _scaling(src, node):
            return True
    return False


def _scaling(src: Source, node: ast.Assign | ast.AugAssign) -> bool:
    """`loss = loss * loss_scale`, `loss = loss * 1024`, `loss *= 128`."""
    value = node.value
    names_a_scale = "scale" in ast.unparse(value).lower()
    if isinstance(node, ast.AugAssign):
        multiplies = isinstance(node.op, ast.Mult)
        return multiplies and (names_a_scale or (flow_of(src).const(value) or 0) > 1)
    return (names_a_scale and _has_mult(value)) or _times_big_constant(src, value)


def _has_mult(node: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) for n in ast.walk(node))


def _times_big_constant(src: Source, node: ast.AST) -> bool:
    """`loss * 1024`, `2**16 * loss`: a static loss scale (a factor below 1 is a weight)."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return False
    return any((flow_of(src).const(side) or 0) > 1 for side in (node.left, node.right))


def _scales_elsewhere(src: Source) -> bool:
    """A GradScaler, or a library that scales the loss, anywhere in the file. When the
    file's only GradScalers are disabled, their uses and names say nothing: only another
    library's scaler class (timm's `NativeScaler`, `ApexScaler`) still counts."""
    disabled = _disabled_scaler(src) is not None
    if scaler_uses(src) and not disabled:
        return True
    for node in src.nodes_of(ast.Name) + src.nodes_of(ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        qualname = src.qualname(node)
        if disabled and (qualname is None or qualname in SCALERS):
            continue
        if qualname in SCALERS or SCALER_NAME.search(name):
            return True
    return any(_library_backward(src, c) for c in src.calls) or _lightning(src)


def _disabled_scaler(src: Source) -> ast.Call | None:
    """The first GradScaler built, when the file builds some and every one with a literal
    `enabled=False`: a pass-through whose `scale(loss)` is the loss itself and whose
    `step(opt)` is `opt.step()`. `enabled=use_amp` (or any expression) may be on."""
    return src.analysis(_first_disabled_scaler)


def _first_disabled_scaler(src: Source) -> ast.Call | None:
    built = [c for c in src.calls if src.qualname(c.func) in SCALERS]
    off = built and all(_literally_disabled(src, c) for c in built)
    return built[0] if off else None


def _literally_disabled(src: Source, scaler: ast.Call) -> bool:
    """`GradScaler(enabled=False)`; `enabled` is the fifth parameter of the CUDA and CPU
    classes, the sixth where `device` comes first (`torch.amp.GradScaler("cuda", ...)`)."""
    name = src.qualname(scaler.func) or ""
    position = 4 if name.startswith(("torch.cuda.amp.", "torch.cpu.amp.")) else 5
    enabled = patterns.arg(scaler, position, "enabled")
    return isinstance(enabled, ast.Constant) and enabled.value is False


def _library_backward(src: Source, call: ast.Call) -> bool:
    func = call.func
    if not isinstance(func, ast.Attribute) or src.qualname(func):  # torch.autograd.backward
        return False
    return func.attr in LIBRARY_BACKWARDS or (func.attr == "backward" and bool(call.args))


def _lightning(src: Source) -> bool:
    """A LightningModule: Lightning's precision plugin scales the loss for `training_step`
    and passes `backward` an already scaled one."""
    defs = src.nodes_of(ast.FunctionDef, ast.AsyncFunctionDef)
    if any(d.name == "training_step" for d in defs):
        return True
    modules = src.imports.aliases.values()
    return any(m.startswith(("lightning", "pytorch_lightning")) for m in modules)


def _entered_at(src: Source, call: ast.Call, factory: bool = False) -> list[ast.expr]:
    """Where the autocast is entered: the call itself, and for `ctx = torch.autocast(...)`
    every `with ctx:` of the file; for a `factory` (`amp_ctx = partial(torch.autocast,
    ...)`) every `with amp_ctx():`."""
    parent = src.parents.get(call, (None, ""))[0]
    while isinstance(parent, ast.IfExp):  # `ctx = nullcontext() if cpu else torch.autocast(...)`
        parent = src.parents.get(parent, (None, ""))[0]
    if not (isinstance(parent, ast.Assign) and len(parent.targets) == 1):
        return [call]
    target = ast.unparse(parent.targets[0])  # NB: not ast.dump, which tells Store from Load
    withs = [
        item.context_expr
        for node in src.nodes_of(ast.With, ast.AsyncWith)
        for item in node.items
        if _enters(item.context_expr, target, factory)
    ]
    return withs or [call]


def _enters(context: ast.expr, target: str, factory: bool) -> bool:
    """`with ctx:` enters `ctx`; `with amp_ctx():` (any arguments) calls a factory first."""
    if factory:
        return isinstance(context, ast.Call) and ast.unparse(context.func) == target
    return ast.unparse(context) == target


def _trains(src: Source, site: ast.AST) -> bool:
    """The autocast at `site` covers code that is differentiated, not evaluation."""
    if patterns.in_no_grad(src, site):
        return False
    function = _function_entering(src, site)
    if function is None:
        return src.tree in differentiated(src)
    if _evaluation(src, function):
        return False
    return function in differentiated(src)


def _function_entering(src: Source, site: ast.AST) -> Definition | None:
    """The function whose code runs under the autocast: the decorated one for
    `@torch.autocast(...)`, else the one around the `with` (None at module level)."""
    parent, field = src.parents.get(site, (None, ""))
    if field == "decorator_list" and isinstance(parent, Definition):
        return parent
    return src.function_of(site)


def _steps_after(
    src: Source, site: ast.AST, backwards: list[ast.Call], steps: list[ast.Call]
) -> bool:
    """Only an optimizer step turns an overflowed gradient into NaN weights: a test that
    backpropagates under float16 to assert on `.grad` trains nothing. Where the code under
    the autocast backpropagates itself, the step must be in its call chain (a helper it
    calls, a caller's loop, another test's optimizer does not count); an autocast whose
    backward is elsewhere (a `forward`) needs a step anywhere in the file."""
    scope = _function_entering(src, site) or src.tree
    if not any((src.function_of(b) or src.tree) is scope for b in backwards):
        return bool(steps)
    chain = call_chain(src, scope)
    return any((src.function_of(s) or src.tree) in chain for s in steps)


def _evaluation(src: Source, function: Definition) -> bool:
    words = set(re.split(r"_+", function.name.lower()))
    backprops = any(_plain_backward(src, c) for c in src.calls_by_function.get(function, []))
    return bool(words & EVAL_WORDS) and not words & {"train", "training"} and not backprops


def _backward_after(src: Source, site: ast.AST, backwards: list[ast.Call]) -> ast.Call:
    """The backward the autocast's loss most likely reaches: the first after the place it
    is entered in the same function, else the file's first."""
    function = src.function_of(site)
    same = [b for b in backwards if src.function_of(b) is function]
    after = [b for b in same if position(b) > position(site)]
    return (after or same or backwards)[0]


def _message(src: Source, autocast: ast.Call, backward: ast.Call) -> str:
    default = patterns.keyword_arg(autocast, "dtype") is None and len(autocast.args) < 2
    what = "autocast (float16, CUDA's default)" if default else "float16 autocast"
    chosen = float16_chosen(src, autocast)
    if chosen is not None:
        what = f"autocast to `{src.segment(chosen)}` (whenever it picks float16)"
    call = src.segment(backward)
    where = "" if backward.lineno == autocast.lineno else from_line(backward.lineno)
    return (
        f"{_remedy(src)} or autocast to `torch.bfloat16`: under {what}, `{call}`"
        f"{where} runs unscaled, so gradients below 6e-8 flush to 0 and one above 65504 "
        f"becomes inf, which reaches the optimizer unskipped and turns the weights NaN."
    )


def _remedy(src: Source) -> str:
    disabled = _disabled_scaler(src)
    if disabled is None:
        return (
            "Add a GradScaler (`scaler.scale(loss).backward()`, `scaler.step(opt)`, "
            "`scaler.update()`)"
        )
    return (
        f"Enable the GradScaler (`{src.segment(disabled)}`{from_line(disabled.lineno)} "
        f"passes the loss through unscaled and never skips a step)"
    )


CHECK = Check(
    id="fp16-without-grad-scaler",
    run=fp16_without_grad_scaler,
    severity=Severity.WARNING,
    summary="Training under float16 autocast with a plain `loss.backward()` and no "
    "GradScaler in the file.",
    invalid=INVALID,
    valid=VALID,
)
