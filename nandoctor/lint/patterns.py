"""The torch vocabulary the checks share: which calls are a softmax, a log, a clip...

Every predicate takes the `Source` (to resolve names through imports) and a call. A call
matches either by qualified name (`torch.log(x)`, `F.softmax(x, -1)` after `import
torch.nn.functional as F`) or as a tensor method (`x.softmax(-1).log()`): a method call
counts only when its receiver is not an imported module (`np.log(x)`, `math.log(x)`) and
not `self` (a module's own `self.log(...)` is Lightning's logger, not `Tensor.log`).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from nandoctor.lint.source import Source

SOFTMAX = frozenset(
    {
        "torch.softmax",
        "torch.nn.functional.softmax",
        "torch.special.softmax",
        "torch.Tensor.softmax",
    }
)
SOFTMAX_MODULES = frozenset({"torch.nn.Softmax", "torch.nn.modules.activation.Softmax"})
SIGMOID_MODULES = frozenset({"torch.nn.Sigmoid", "torch.nn.modules.activation.Sigmoid"})
LOG_FUNCTIONS = frozenset({"torch.log", "torch.log2", "torch.log10", "torch.Tensor.log"})
LOG_METHODS = frozenset({"log", "log_", "log2", "log10"})
CLIP = frozenset(
    f"torch.nn.utils.{module}{name}"
    for module in ("", "clip_grad.")
    for name in ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_", "clip_grads_with_norm_")
)
ADAM = frozenset(
    f"torch.optim.{name}" for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "SparseAdam")
)
NO_GRAD = frozenset(
    {
        "torch.no_grad",
        "torch.inference_mode",
        "torch.autograd.no_grad",
        "torch.autograd.grad_mode.no_grad",
        "torch.autograd.grad_mode.inference_mode",
    }
)
FLOAT16 = frozenset({"torch.float16", "torch.half"})
AUTOCAST = frozenset(
    {"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast"}
)
GRAD_SCALERS = frozenset(
    {"torch.cuda.amp.GradScaler", "torch.amp.GradScaler", "torch.GradScaler"}
    | {"torch.cpu.amp.GradScaler", "torch.amp.grad_scaler.GradScaler"}
)

# NB: the words (`lr_scheduler` -> lr, scheduler) of receivers whose `.step()` updates no
# weights: LR schedulers, the profiler, an EMA, an RL environment, early stopping, progress.
NOT_OPTIMIZER_WORDS = ("sched", "prof", "ema", "env", "stop", "pbar", "progress", "timer", "warmup")

VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "squeeze", "unsqueeze", "squeeze_",
    "unsqueeze_", "flatten", "transpose", "permute", "t", "contiguous", "clone", "detach",
    "float", "double", "half", "bfloat16", "to", "type", "type_as", "cpu", "cuda", "gather",
    "index_select", "expand", "expand_as", "repeat", "narrow", "select", "take_along_dim",
    "item", "triu", "tril", "masked_fill", "masked_fill_",
})  # fmt: skip
VIEW_FUNCTIONS = frozenset(
    f"torch.{n}"
    for n in ("gather", "index_select", "take_along_dim", "squeeze", "unsqueeze", "flatten",
              "reshape", "transpose", "permute", "triu", "tril")
)  # fmt: skip
CLAMPS = frozenset({"clamp", "clamp_", "clamp_min", "clamp_min_", "clip", "clip_", "maximum"})
# NB: autocast runs these in float16 whatever their inputs (CPU and CUDA alike); casts to
# float32 survive everything else.
AUTOCAST_FP16 = frozenset({
    "matmul", "mm", "bmm", "addmm", "addbmm", "baddbmm", "addmv", "mv", "linear", "conv1d",
    "conv2d", "conv3d", "einsum", "half", "bfloat16", "prelu", "chain_matmul",
})  # fmt: skip


def qualname(src: Source, call: ast.Call) -> str | None:
    return src.qualname(call.func)


def method_receiver(src: Source, call: ast.Call, names: frozenset[str]) -> ast.expr | None:
    """`x` for `x.<name>(...)` when `x` is a value (a tensor, we assume), not a module."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in names):
        return None
    receiver = func.value
    if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
        return None
    if src.qualname(receiver) is not None:  # a module: np.log, math.log, torch.log
        return None
    return receiver


def first_arg(call: ast.Call, keyword: str = "input") -> ast.expr | None:
    if call.args and not isinstance(call.args[0], ast.Starred):
        return call.args[0]
    return keyword_arg(call, keyword)


def keyword_arg(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def arg(call: ast.Call, index: int, name: str) -> ast.expr | None:
    """The argument passed at position `index` or as keyword `name`."""
    positional = [a for a in call.args if not isinstance(a, ast.Starred)]
    if len(positional) == len(call.args) and index < len(positional):
        return positional[index]
    return keyword_arg(call, name)


def softmax_input(src: Source, call: ast.Call) -> ast.expr | None:
    """The tensor a softmax call normalises, or None when `call` is no softmax."""
    if qualname(src, call) in SOFTMAX:
        return first_arg(call)
    return method_receiver(src, call, frozenset({"softmax"}))


def log_input(src: Source, call: ast.Call) -> ast.expr | None:
    """The argument of `torch.log(x)` / `x.log()` (and log2, log10), else None."""
    if qualname(src, call) in LOG_FUNCTIONS:
        return first_arg(call)
    if call.args or call.keywords:
        return None  # NB: Tensor.log takes no arguments; logger.log(...) does
    return method_receiver(src, call, LOG_METHODS)


def logs(src: Source) -> Iterator[tuple[ast.Call, ast.expr]]:
    """Each torch log call of the file, with the tensor it takes the log of."""
    for call in src.calls:
        argument = log_input(src, call)
        if argument is not None:
            yield call, argument


def log_name(src: Source, call: ast.Call) -> str:
    """How the code spells its log: `torch.log`, `F.log`... or `.log()`."""
    name = src.qualname(call.func)
    if name is not None:
        return name.replace("torch.nn.functional", "F")
    return f".{call.func.attr}()" if isinstance(call.func, ast.Attribute) else "log"


def is_clip(src: Source, call: ast.Call) -> bool:
    """torch's own gradient clipping (not `accelerator.clip_grad_norm_`, which unscales)."""
    return qualname(src, call) in CLIP


def is_optimizer_step(src: Source, call: ast.Call) -> bool:
    """An update of the weights: `opt.step()`, `self.optimizer.step()`, `optimizers[0].step()`,
    `optimizer.step(closure)` (LBFGS), `scaler.step(opt)`. An optimizer can have any name, so
    the shape decides: a `step` method with no argument, or one on an optimizer or scaler.
    Not the `step()` of an LR scheduler, the profiler, an EMA or early stopping (their names
    say so), not `env.step(action)` or a diffusion scheduler's `step(noise, t, x)`, not a
    module's function or the class's own `self.step()`."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "step"):
        return False
    receiver = func.value
    if src.qualname(receiver) is not None or getattr(receiver, "id", "") in ("self", "cls"):
        return False
    words = re.split(r"[^a-z]+", ast.unparse(receiver).lower())
    if any(w.startswith(NOT_OPTIMIZER_WORDS) for w in words):
        return False
    arguments = [*call.args, *call.keywords]
    if not arguments:
        return True
    closure = len(call.keywords) == 1 and call.keywords[0].arg == "closure"
    named = any(w.startswith(("opt", "scaler")) or w.endswith("scaler") for w in words)
    return len(arguments) == 1 and (closure or named)


def is_no_grad(src: Source, expr: ast.expr) -> bool:
    """`torch.no_grad()`, `torch.inference_mode()`, `torch.set_grad_enabled(False)`."""
    target = expr.func if isinstance(expr, ast.Call) else expr
    name = src.qualname(target)
    if name in NO_GRAD:
        return True
    if name == "torch.set_grad_enabled" and isinstance(expr, ast.Call) and expr.args:
        first = expr.args[0]
        return isinstance(first, ast.Constant) and first.value is False
    return False


def in_no_grad(src: Source, node: ast.AST) -> bool:
    """True when `node` runs with autograd off: inside `with torch.no_grad():` or in a
    function decorated with it."""
    for a in src.ancestors(node):
        if isinstance(a, (ast.With, ast.AsyncWith)):
            contexts = [item.context_expr for item in a.items]
        elif isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
            contexts = a.decorator_list
        else:
            continue
        if any(is_no_grad(src, c) for c in contexts):
            return True
    return False


def guarded(src: Source, node: ast.AST, value: ast.AST) -> bool:
    """True when an enclosing `if`/`while`/ternary of the same function tests `value`'s
    names: `if norm > 1: x = x / norm` never divides by 0."""
    names = _names(value)
    for a in src.ancestors(node):
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return False
        if isinstance(a, (ast.If, ast.While, ast.IfExp)) and names & _names(a.test):
            return True
    return False


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - {"self"}
