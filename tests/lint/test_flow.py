"""The data flow: what a variable holds where it is read, in one function at a time."""

from __future__ import annotations

import ast

from nandoctor.lint.flow import flow_of
from nandoctor.lint.source import Source
from nandoctor.lint.tags import Kind


def kinds_of(code: str, expression: str) -> set[Kind]:
    """The tag kinds of the last occurrence of `expression` in `code`."""
    src = Source("<test>", code)
    nodes = [n for n in src.nodes if isinstance(n, ast.expr) and ast.unparse(n) == expression]
    return {t.kind for t in flow_of(src).tags(nodes[-1])}


def const_of(code: str, expression: str) -> float | None:
    src = Source("<test>", code)
    nodes = [n for n in src.nodes if isinstance(n, ast.expr) and ast.unparse(n) == expression]
    return flow_of(src).const(nodes[-1])


def test_a_softmax_travels_through_names_views_and_gathers():
    code = "import torch\np = torch.softmax(z, -1)\nq = p.float()[:, 0]\nr = q.gather(1, y)\nr\n"
    assert Kind.SOFTMAX in kinds_of(code, "r")


def test_rebinding_forgets_and_branches_read_in_order():
    code = "import torch\np = torch.softmax(z, -1)\np = torch.sigmoid(z)\np\n"
    assert kinds_of(code, "p") == {Kind.POSITIVE, Kind.SIGMOID}


def test_one_minus_a_sigmoid_is_its_complement():
    code = "import torch\np = torch.sigmoid(z)\nq = 1 - p\nr = 2 - p\ns = p.sum()\nq, r, s\n"
    assert kinds_of(code, "q") == {Kind.COMPLEMENT}
    assert kinds_of(code, "r") == set()
    assert Kind.SIGMOID not in kinds_of(code, "s")  # a sum of sigmoids is no probability


def test_an_added_constant_is_an_epsilon():
    code = "import torch\np = torch.softmax(z, -1)\nq = p + 1e-8\nq\n"
    assert {Kind.SOFTMAX_EPS, Kind.EPS_ADDED} <= kinds_of(code, "q")
    assert Kind.SOFTMAX not in kinds_of(code, "q")


def test_each_function_has_its_own_variables():
    code = "import torch\ndef f(z):\n    p = torch.softmax(z, -1)\ndef g(p):\n    return p\n"
    assert kinds_of(code, "p") == set()


def test_module_level_names_are_seen_from_functions():
    code = "import torch\nEPS = 1e-10\ndef f(x):\n    return x + EPS\n"
    assert const_of(code, "EPS") == 1e-10


def test_constants_fold_and_come_from_defaults_and_self():
    assert const_of("y = 2 ** -30\ny\n", "y") == 2.0**-30
    assert const_of("import math\nx = -math.inf\nx\n", "x") == float("-inf")
    assert const_of("x = float('-inf')\nx\n", "x") == float("-inf")
    code = (
        "class N:\n    def __init__(self, eps=1e-12):\n        self.eps = eps\n"
        "    def forward(self, x):\n        return x + self.eps\n"
    )
    assert const_of(code, "self.eps") == 1e-12


def test_an_nn_softmax_attribute_makes_its_calls_softmaxes():
    code = (
        "import torch.nn as nn\nclass M(nn.Module):\n    def __init__(self):\n"
        "        self.sm = nn.Softmax(dim=1)\n"
        "    def forward(self, x):\n        return self.sm(x)\n"
    )
    assert kinds_of(code, "self.sm(x)") == {Kind.SOFTMAX}


def test_an_nn_sigmoid_module_makes_its_calls_sigmoids_as_does_a_stack_ending_in_one():
    code = (
        "import torch.nn as nn\nclass M(nn.Module):\n    def __init__(self):\n"
        "        self.act = nn.Sigmoid()\n"
        "        self.head = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())\n"
        "    def forward(self, x):\n        return self.act(x), self.head(x)\n"
    )
    assert kinds_of(code, "self.act(x)") == {Kind.SIGMOID, Kind.POSITIVE}
    assert kinds_of(code, "self.head(x)") == {Kind.SIGMOID, Kind.POSITIVE}
    assert kinds_of(code.replace("nn.Sigmoid()", "nn.ReLU()"), "self.act(x)") == set()


def test_neg_inf_fills_in_place_and_by_item_assignment():
    code = "import math\ns.masked_fill_(m, -math.inf)\nt[m] = float('-inf')\ns + t\n"
    assert kinds_of(code, "s + t") == {Kind.NEG_INF}


def test_augmented_assignment_combines():
    code = "import torch\nd = x.sum()\nd += 1e-8\nd\n"
    assert kinds_of(code, "d") == {Kind.EPS_ADDED}


def test_reductions():
    code = "import torch\na = (x ** 2).sum(-1)\nb = x.norm()\nc = torch.exp(x).sum()\nd = x.var()\n"
    assert {Kind.SQUARES, Kind.ZEROABLE} <= kinds_of(code + "a\n", "a")
    assert Kind.ZEROABLE in kinds_of(code + "b\n", "b")
    assert Kind.ZEROABLE not in kinds_of(code + "c\n", "c")
    assert Kind.SQUARES in kinds_of(code + "d\n", "d")


def test_float32_where_the_code_casts_itself():
    code = "import torch\na = x.float().abs()\nb = x.norm()\nc = (x.float() @ w).sum()\n"
    assert Kind.FLOAT32 in kinds_of(code + "a\n", "a")
    assert Kind.FLOAT32 not in kinds_of(code + "b\n", "b"), "float16 on the CPU"
    assert Kind.FLOAT32 not in kinds_of(code + "c\n", "c"), "autocast runs matmul in float16"


def test_a_class_whose_forward_returns_a_softmax():
    code = (
        "import torch\nclass Net(torch.nn.Module):\n    def forward(self, x):\n"
        "        return torch.softmax(x, -1)\nmodel = Net()\nout = model(x)\nout\n"
    )
    assert kinds_of(code, "out") == {Kind.SOFTMAX}


def test_float16_travels_through_a_dtype_lookup_and_a_conditional():
    code = (
        "import torch\nfrom torch import half as h\n"
        "table = {'fp32': torch.float32, 'fp16': torch.float16}\n"
        "a = table[name]\nb = torch.bfloat16 if bf16 else h\nc = {'bf16': torch.bfloat16}[name]\n"
        "def f():\n    return a, b, c\n"
    )
    assert Kind.FLOAT16 in kinds_of(code, "a")
    assert Kind.FLOAT16 in kinds_of(code, "b")
    assert Kind.FLOAT16 not in kinds_of(code, "c")


def test_a_fact_of_the_file_is_computed_once_and_kept_by_its_source():
    """Every check asks for the flow (and the differentiated functions...): the `Source`
    keeps each such fact, so a file is analysed once, not once per check."""
    src = Source("<test>", "import torch\np = torch.softmax(z, -1)\n")
    calls: list[Source] = []

    def count(of: Source) -> int:
        calls.append(of)
        return len(calls)

    assert (src.analysis(count), src.analysis(count)) == (1, 1)
    assert calls == [src]
    assert flow_of(src) is flow_of(src)
    assert flow_of(Source("<test>", src.text)) is not flow_of(src), "one file's, not shared"
