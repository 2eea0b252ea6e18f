"""The context checks read: which code is differentiated, how float16 is used, where a
GradScaler is driven (nandoctor/lint/grad.py, fp16.py, scaler.py)."""

from __future__ import annotations

import ast

from nandoctor.lint.fp16 import float16_use
from nandoctor.lint.grad import differentiated
from nandoctor.lint.scaler import scaler_uses
from nandoctor.lint.source import Source


def functions(src: Source, names: set[ast.AST]) -> set[str]:
    return {getattr(n, "name", "<module>") for n in names}


def test_differentiated_code_is_reached_from_forward_loss_or_backward():
    src = Source(
        "<t>",
        "def dist(a, b): ...\n"
        "def compute_loss(a, b):\n    return dist(a, b)\n"
        "def load(path): ...\n"
        "def constraint(x): ...\n"
        "class M:\n    def forward(self, x):\n        return self.head(x)\n"
        "    def head(self, x): ...\n    def get_map(self, x): ...\n"
        "def fit(m, opt):\n    m(x).sum().backward()\n"
        "import torch\n@torch.no_grad()\ndef train_eval(x): ...\n",
    )
    assert functions(src, differentiated(src)) == {"dist", "compute_loss", "forward", "head", "fit"}


def test_float16_casts_of_models_versus_inputs():
    model = float16_use(Source("<t>", "import torch\nnet = Net().cuda().half()\n"))
    assert model.casts == {"net"} and model.any
    by_use = float16_use(Source("<t>", "import torch\nm = build()\nm.half()\nm.parameters()\n"))
    assert by_use.casts == {"m"}
    inputs = float16_use(Source("<t>", "import torch\nimages = images.half()\n"))
    assert inputs.casts == frozenset() and inputs.mentioned
    autocast = float16_use(Source("<t>", "import torch\nwith torch.cuda.amp.autocast():\n  pass\n"))
    assert autocast.casts == frozenset() and autocast.mentioned
    bf16 = float16_use(
        Source("<t>", "import torch\nwith torch.autocast('cuda', dtype=torch.bfloat16):\n  pass\n")
    )
    assert not bf16.any
    default = float16_use(Source("<t>", "import torch\ntorch.set_default_dtype(torch.float16)\n"))
    assert default.casts == {"*"}


def test_scaler_uses_per_function():
    src = Source(
        "<t>",
        "def a(s, loss, opt):\n    s.scale(loss).backward()\n    s.unscale_(opt)\n    s.step(opt)\n"
        "def b(self, opt):\n    self.grad_scaler.step(opt)\n"
        "def c(opt):\n    opt.step()\n    torch.scale(x)\n",
    )
    uses = {u.scope.name: u for u in scaler_uses(src)}  # type: ignore[attr-defined]
    assert set(uses) == {"a", "b"}
    assert (len(uses["a"].scales), len(uses["a"].unscales), len(uses["a"].steps)) == (1, 1, 1)
    assert uses["b"].scales == () and len(uses["b"].steps) == 1


def test_a_segment_is_the_nodes_text_on_one_line_columns_in_characters():
    text = "import torch\r\nname = 'é'; y = torch.log(\n    torch.softmax(x,\n dim=-1))\n"
    src = Source("<t>", text)
    call = next(n for n in ast.walk(src.tree) if isinstance(n, ast.Call))
    assert src.segment(call) == "torch.log( torch.softmax(x, dim=-1))"
    name = next(n for n in ast.walk(src.tree) if isinstance(n, ast.Constant))
    assert src.segment(name) == "'é'"
