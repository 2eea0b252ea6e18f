"""'internal error' is nandoctor's own bug, never the user's.

Every place that can print it is found by reading the package (one today: the CLI's
`unexpected_error`, for an exception no module turned into a message); each kind of
exception a user's config, code or machine can raise there is classified as theirs; and
a matrix of user faults, run as users run them, ends each with its own message and exit
code (several of them were 'internal error: ...' before)."""

from __future__ import annotations

import ast
import errno
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import nandoctor
from nandoctor.cli import app
from nandoctor.cli.app import unexpected_error
from nandoctor.errors import ExitCode, UserCodeError, UserExit

PACKAGE = Path(nandoctor.__file__).parent


def producers() -> set[str]:
    """`file:function` of every string in the package that says 'internal error' (the
    docstrings aside, which describe it)."""
    found: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        finder = _Sayers(path.relative_to(PACKAGE).as_posix())
        finder.visit(ast.parse(path.read_text(encoding="utf-8")))
        found |= finder.found
    return found


class _Sayers(ast.NodeVisitor):
    def __init__(self, where: str) -> None:
        self.where, self.found, self.inside = where, set(), ["<module>"]

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.inside.append(node.name)
        self._body(node)
        self.inside.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Module(self, node: ast.Module) -> None:
        self._body(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._body(node)

    def _body(
        self, node: ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    ) -> None:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # NB: the docstring
        for child in body:
            self.visit(child)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and "internal error" in node.value.lower():
            self.found.add(f"{self.where}:{self.inside[-1]}")


def test_one_place_says_internal_error_and_only_for_what_no_module_explained():
    """A new place that prints 'internal error' must be added here, and reachable from
    nandoctor's own bugs only."""
    assert producers() == {"cli/app.py:unexpected_error"}


def _raised_in(filename: str, error: BaseException) -> BaseException:
    """`error` as if raised by code in `filename` (its traceback's last frame there)."""
    code = compile("raise error", filename, "exec")
    try:
        exec(code, {"error": error})
    except BaseException as e:
        return e
    raise AssertionError("unreachable")


# what reaches `unexpected_error` from the user's config, code or machine: (name, error,
# the message it gives, its exit code)
USERS = [
    ("sys.exit outside our calls", lambda: SystemExit(4), "your code called sys.exit(4)", 3),
    ("a full disk", lambda: OSError(errno.ENOSPC, "No space left on device"), "no space left on the device", 2),
    ("a permission", lambda: PermissionError(errno.EACCES, "Permission denied", "/x/cache"), "Permission denied: /x/cache", 2),
    ("too many open files", lambda: OSError(errno.EMFILE, "Too many open files"), "Too many open files", 2),
    ("host memory", MemoryError, "out of memory", 2),
    ("device memory", lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "out of memory: CUDA out of memory", 2),
    ("the CPU allocator's memory", lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"), "out of memory: DefaultCPUAllocator: can't allocate memory", 2),
    ("a symlink loop (pathlib before 3.13)", lambda: RuntimeError("Symlink loop from '/w/a'"), "a symbolic link that leads to itself: /w/a", 2),
    ("raised in the user's file", lambda: _raised_in(str(Path("/home/u/train.py")), KeyError("w")), "your code raised KeyError: 'w'", 3),
]  # fmt: skip


@pytest.mark.parametrize(("name", "make", "message", "code"), USERS, ids=[u[0] for u in USERS])
def test_what_the_user_raises_there_is_the_users(name, make, message, code):
    error = unexpected_error(make())
    assert message in error.message and "internal error" not in error.message
    assert error.exit_code == code


def test_what_nandoctor_raises_there_is_its_own_bug():
    error = unexpected_error(_raised_in(str(PACKAGE / "diagnose" / "engine.py"), KeyError("w")))
    assert error.message == "internal error: KeyError: 'w'"
    assert error.exit_code == ExitCode.USAGE and "a bug in nandoctor" in str(error.hint)
    assert not isinstance(error, (UserCodeError, UserExit))


USER_PY = """
import torch
import torch.nn.functional as F
from torch import nn
from train import build_data, build_model


def meta_model():
    with torch.device("meta"):  # "to build it fast", then never materialised
        return build_model()


def half_model():
    return build_model().half()


def float16_by_default():
    torch.set_default_dtype(torch.float16)
    return build_model()


class SparseEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.emb((x.abs() * 3).long().clamp(0, 9)).mean(1))


class GreedyUnderTrace(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = build_model()

    def forward(self, x):
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        if _get_current_dispatch_mode_stack():  # the tracer: every op checked
            torch.empty(2**50, dtype=torch.uint8)
        return self.net(x)


def complex_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y) * 1j


def meta_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y).to("meta")


def greedy_loss(model, batch):
    torch.empty(2**50, dtype=torch.uint8)


def halving_loss(model, batch):
    halving_loss.calls = getattr(halving_loss, "calls", 0) + 1
    if halving_loss.calls == 2:
        model.half()  # "to save memory", mid-run
    x, y = batch
    return F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)


def recursing_loss(model, batch):
    return recursing_loss(model, batch)


def sparse_hook_model():
    model = build_model()
    model[0].weight.register_hook(lambda g: g.to_sparse())
    return model


def not_an_optimizer(params, lr):
    return "AdamW"
"""

BASE = """\
model: train.py:build_model
data: train.py:build_data
optimizer: {name: SGD, lr: 0.1}
precision: {dtype: float32}
steps: 3
device: cpu
"""

# (name, the config's changed lines, the command's other arguments, exit code, message)
FAULTS = [
    # the config
    ("a meta-device model", "model: user.py:meta_model", (), 2, "config.yaml:1: model: user.py:meta_model built a model whose weights are on the meta device, with no values (0.weight, 0.bias, 2.weight, ... (4 in all))"),
    ("float16 weights under a GradScaler", "model: user.py:half_model\nprecision: {dtype: float16}", (), 2, "precision.grad_scaler: the optimizer's parameters are float16"),
    ("float16 by default under a GradScaler", "model: user.py:float16_by_default\nprecision: {dtype: float16}", (), 2, "precision.grad_scaler: the optimizer's parameters are float16"),
    ("clipping sparse gradients", "model: user.py:SparseEmbedding\nclip_grad_norm: 1.0", (), 2, "clip_grad_norm: torch.nn.utils.clip_grad_norm_ cannot clip sparse gradients (emb.weight"),
    ("an optimizer factory returning a name", "optimizer: {factory: 'user.py:not_an_optimizer', lr: 0.1}", (), 2, "optimizer: user.py:not_an_optimizer returned a str, expected a torch.optim.Optimizer"),
    ("an alias bomb", "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\ne: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\nf: [*e, *e]", (), 2, "its aliases expand to more than 100000 values"),
    ("CUDA where there is none", "device: cuda", (), 2, "device: 'cuda' asked for, but torch.cuda.is_available() is False"),
    # the user's code
    ("a complex loss", "loss: user.py:complex_loss", (), 2, "loss: returned a complex tensor, expected a real scalar with a value"),
    ("a loss on the meta device", "loss: user.py:meta_loss", (), 2, "loss: returned a meta-device (valueless) tensor"),
    ("weights made float16 mid-run", "loss: user.py:halving_loss\nprecision: {dtype: float16}", (), 2, "precision.grad_scaler: the optimizer's parameters are float16"),
    ("a gradient hook that makes it sparse", "model: user.py:sparse_hook_model", (), 3, "backward (step 0) raised RuntimeError: hook '<lambda>' has changed the type of value"),
    ("endless recursion in the loss", "loss: user.py:recursing_loss", (), 3, "loss (step 0) raised RecursionError: maximum recursion depth exceeded"),
    # the machine
    ("the CPU out of memory in the loss", "loss: user.py:greedy_loss", (), 2, "loss (step 0) ran out of memory: DefaultCPUAllocator: can't allocate memory"),
    ("the CPU out of memory in the replay", "model: user.py:GreedyUnderTrace\ndata_args: {nan_at: 2}", ("--no-verify",), 2, "out of memory in the instrumented replay of step 2, in the full trace of step 2 and again in the lighter one"),
    ("a report on a full device", "", ("--json", "/dev/full"), 2, "--json /dev/full: cannot write the report: no space left"),
    ("a config that is a folder", "", ("CONFIG=.",), 2, ".: cannot read the config file: [Errno 21] Is a directory"),
]  # fmt: skip


@pytest.fixture
def folder(tmp_path, monkeypatch):
    from tests.helpers.project import TRAIN_PY

    (tmp_path / "train.py").write_text(TRAIN_PY)
    (tmp_path / "user.py").write_text(textwrap.dedent(USER_PY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("user", None)


def configured(folder: Path, extra: str) -> Path:
    lines = {line.split(":")[0]: line for line in BASE.splitlines()}
    for line in extra.splitlines():
        lines[line.split(":")[0]] = line
    (folder / "config.yaml").write_text("\n".join(lines.values()) + "\n")
    return folder / "config.yaml"


@pytest.mark.parametrize(
    ("name", "extra", "args", "code", "message"), FAULTS, ids=[f[0] for f in FAULTS]
)
def test_each_user_fault_has_its_own_message_never_internal_error(
    folder, name, extra, args, code, message
):
    if name.startswith("CUDA") and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    config = str(configured(folder, extra))
    config = next((a.removeprefix("CONFIG=") for a in args if a.startswith("CONFIG=")), config)
    args = tuple(a for a in args if not a.startswith("CONFIG="))
    result = CliRunner().invoke(app, ["diagnose", config, "-q", *args])
    assert "internal error" not in result.output, result.output
    assert result.exit_code == code, result.output
    assert message in result.output


@pytest.mark.skipif(sys.platform == "win32", reason="symlinks")
def test_a_symlink_loop_given_to_lint_is_named(folder):
    (folder / "a.py").symlink_to(folder / "b.py")
    (folder / "b.py").symlink_to(folder / "a.py")
    result = CliRunner().invoke(app, ["lint", "a.py"])
    assert "internal error" not in result.output
    assert result.exit_code == 2, result.output
    assert "a symbolic link that leads to itself" in result.output
