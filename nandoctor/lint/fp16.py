"""Does this file train in float16, and how: its own casts, or autocast only?

    model = Net().cuda().half()                     casts: model  (weights, Adam state: float16)
    model.to(device, dtype=torch.float16)           casts: model
    images = images.half()                          float16 mentioned (an input, not weights)
    with torch.autocast("cuda", dtype=torch.float16): ...   autocast only: norms, sums,
                                                    softmax and the optimizer stay float32

The difference matters for epsilons: autocast runs layer_norm, batch_norm and the
optimizer update in float32, so their `eps` survives; a `.half()` model does not.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from nandoctor.lint import patterns
from nandoctor.lint.flow import flow_of
from nandoctor.lint.scaler import scaler_uses
from nandoctor.lint.source import Source
from nandoctor.lint.tags import Kind

HALF_TENSOR_TYPES = frozenset({"torch.HalfTensor", "torch.cuda.HalfTensor"})
MODEL_NAMES = re.compile(
    r"model|net|module|encoder|decoder|transformer|generator|discriminator|policy|critic"
    r"|actor|backbone|layer|block|\*",
    re.IGNORECASE,
)
MODEL_METHODS = frozenset(
    {"parameters", "named_parameters", "state_dict", "load_state_dict", "train", "eval", "modules"}
)


@dataclass(frozen=True)
class Float16Use:
    casts: frozenset[str]  # names cast to float16 ("*": everything, set_default_dtype)
    mentioned: bool  # float16 appears at all: autocast, GradScaler, torch.float16

    @property
    def any(self) -> bool:
        return bool(self.casts) or self.mentioned

    def half_parameters(self, src: Source, optimizer: ast.Call) -> bool:
        """The optimizer's first argument names something cast to float16, directly
        (`model.parameters()`) or through one assignment (`params = [p for p in
        model.parameters() if p.requires_grad]`)."""
        params = patterns.first_arg(optimizer, "params")
        if params is None:
            return False
        names = identifiers(params)
        for node in src.nodes_of(ast.Assign):
            targets = {t.id for t in node.targets if isinstance(t, ast.Name)}
            if targets & names:
                names |= identifiers(node.value)
        return "*" in self.casts or bool(self.casts & names)


def float16_use(src: Source) -> Float16Use:
    casts: set[str] = set()
    for call in src.calls:
        casts.update(_cast_targets(src, call))
    models = {name for name in casts if name == "*" or _is_model(src, name)}
    mentioned = bool(casts - models) or bool(scaler_uses(src))
    mentioned = mentioned or any(
        src.qualname(n) in patterns.FLOAT16 | patterns.GRAD_SCALERS
        for n in src.nodes_of(ast.Attribute)
    )
    mentioned = mentioned or any(_default_float16_autocast(src, c) for c in src.calls)
    return Float16Use(frozenset(models), mentioned)


def _is_model(src: Source, name: str) -> bool:
    """`model.half()` casts weights; `images.half()` only an input. A model is named like
    one, or has `.parameters()`, `.state_dict()`, `.train()`... called on it."""
    if MODEL_NAMES.search(name):
        return True
    return any(
        isinstance(call.func, ast.Attribute)
        and call.func.attr in MODEL_METHODS
        and name in _last_identifier(call.func.value)
        for call in src.calls
    )


def _cast_targets(src: Source, call: ast.Call) -> set[str]:
    """The last identifiers of what `call` casts to float16: `model` for `model.half()`,
    and the assignment target for `m = Net().cuda().half()`."""
    if src.qualname(call.func) == "torch.set_default_dtype" and _is_half(src, call.args):
        return {"*"}
    receiver = patterns.method_receiver(src, call, frozenset({"half", "to", "type"}))
    if receiver is None or not isinstance(call.func, ast.Attribute):
        return set()
    method = call.func.attr
    values = [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]
    if (method == "half" and not call.args) or (method != "half" and _is_half(src, values)):
        return _last_identifier(receiver) | _assigned_to(src, call)
    return set()


def _is_half(src: Source, values: list[ast.expr]) -> bool:
    for value in values:
        name = src.qualname(value)
        literal = value.value if isinstance(value, ast.Constant) else None
        if name in patterns.FLOAT16 | HALF_TENSOR_TYPES or literal == "torch.HalfTensor":
            return True
    return False


def _default_float16_autocast(src: Source, call: ast.Call) -> bool:
    """`torch.cuda.amp.autocast()` and `torch.autocast("cuda")` default to float16."""
    name = src.qualname(call.func)
    if name not in patterns.AUTOCAST or patterns.keyword_arg(call, "dtype") is not None:
        return False
    device = patterns.arg(call, 0, "device_type")
    is_cpu = isinstance(device, ast.Constant) and device.value == "cpu"
    return name == "torch.cuda.amp.autocast" or (not is_cpu and name != "torch.cpu.amp.autocast")


# NB: the dtype an autocast without `dtype=` uses, by device type (torch.get_autocast_dtype);
# xpu's default changed across releases, so only these two are counted on.
DEFAULT_FLOAT16_DEVICES = frozenset({"cuda", "mps"})


def autocast_call(src: Source, call: ast.Call) -> ast.Call | None:
    """The autocast that `call` builds: `call` itself, or for timm's
    `partial(torch.autocast, device_type=..., dtype=...)` the call the partial stands for
    (its arguments, entered later by `with amp_autocast():`). None for anything else."""
    if src.qualname(call.func) in patterns.AUTOCAST:
        return call
    if src.qualname(call.func) != "functools.partial" or not call.args:
        return None
    if src.qualname(call.args[0]) not in patterns.AUTOCAST:
        return None
    bound = ast.Call(func=call.args[0], args=call.args[1:], keywords=call.keywords)
    return ast.copy_location(bound, call)


def float16_autocast(src: Source, call: ast.Call) -> bool:
    """`call` enters autocast to float16: `dtype=torch.float16` (or `torch.half`, through any
    alias), or no dtype where the device's default is float16 (`torch.cuda.amp.autocast()`,
    `torch.autocast("cuda")`, a device held in a variable), or a dtype the data flow says
    may be float16 (`float16_chosen`). Not `enabled=False`, not the CPU's autocast (bfloat16
    by default), not a dtype whose value the file does not show."""
    name = src.qualname(call.func)
    if name not in patterns.AUTOCAST or _disabled(call, name):
        return False
    with_device = name in ("torch.autocast", "torch.amp.autocast")
    dtype = patterns.arg(call, 1, "dtype")
    if dtype is not None:
        return _is_half(src, [dtype]) or float16_chosen(src, call) is not None
    if not with_device:
        return name == "torch.cuda.amp.autocast"
    device = patterns.arg(call, 0, "device_type")
    if isinstance(device, ast.Constant):
        return str(device.value).split(":")[0] in DEFAULT_FLOAT16_DEVICES
    return True  # NB: `device_type=device.type` is "cuda" on the GPU the run is for


def float16_chosen(src: Source, call: ast.Call) -> ast.expr | None:
    """The autocast's dtype when it is not float16 by name but a value that can be:
    nanoGPT's and llm.c's `ptdtype = {'float32': ..., 'bfloat16': ..., 'float16':
    torch.float16}[dtype]`, `torch.float16 if args.fp16 else torch.bfloat16`, a variable
    assigned either. float16 is then one choice of a flag, so a finding says "when"."""
    dtype = patterns.arg(call, 1, "dtype")
    if dtype is None or _is_half(src, [dtype]):
        return None
    return dtype if flow_of(src).has(dtype, Kind.FLOAT16) else None


def _disabled(call: ast.Call, name: str) -> bool:
    position = 2 if name in ("torch.autocast", "torch.amp.autocast") else 0
    enabled = patterns.arg(call, position, "enabled")
    return isinstance(enabled, ast.Constant) and enabled.value is False


def _assigned_to(src: Source, call: ast.Call) -> set[str]:
    node: ast.AST = call
    while node in src.parents:
        parent = src.parents[node][0]
        if isinstance(parent, ast.Assign):
            return set().union(*(_last_identifier(t) for t in parent.targets))
        if not isinstance(parent, (ast.Call, ast.Attribute)):
            return set()
        node = parent
    return set()


def _last_identifier(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return set()


def identifiers(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
    }
