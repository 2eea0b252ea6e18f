"""Name resolution: imports, aliases and shadowing decide what `log` and `softmax` mean."""

from __future__ import annotations

import ast

import pytest

from nandoctor.lint.source import Source


def resolve(code: str, expression: str) -> str | None:
    """The qualified name of the last occurrence of `expression` in `code`."""
    src = Source("<test>", code)
    nodes = [n for n in src.nodes if isinstance(n, ast.expr) and ast.unparse(n) == expression]
    return src.qualname(nodes[-1])


@pytest.mark.parametrize(
    ("code", "expression", "qualified"),
    [
        ("import torch\ntorch.log(x)", "torch.log", "torch.log"),
        (
            "import torch.nn.functional as F\nF.softmax(x)",
            "F.softmax",
            "torch.nn.functional.softmax",
        ),
        (
            "from torch.nn import functional as F\nF.softmax(x)",
            "F.softmax",
            "torch.nn.functional.softmax",
        ),
        ("from torch import log\nlog(x)", "log", "torch.log"),
        (
            "from torch.nn.functional import softmax as sm\nsm(x)",
            "sm",
            "torch.nn.functional.softmax",
        ),
        (
            "import torch.nn.functional\ntorch.nn.functional.softmax(x)",
            "torch.nn.functional.softmax",
            "torch.nn.functional.softmax",
        ),
        (
            "import torch\nfun = torch.nn.functional\nfun.softmax(x)",
            "fun.softmax",
            "torch.nn.functional.softmax",
        ),
        ("from torch import *\nsoftmax(x)", "softmax", "torch.softmax"),
        ("import numpy as np\nnp.log(x)", "np.log", "numpy.log"),
        ("import math\nmath.log(x)", "math.log", "math.log"),
        # a pasted snippet or notebook cell: the conventional names, never imported
        ("x = torch.log(y)", "torch.log", "torch.log"),
        ("F.softmax(x)", "F.softmax", "torch.nn.functional.softmax"),
        ("nn.functional.softmax(x)", "nn.functional.softmax", "torch.nn.functional.softmax"),
    ],
)
def test_imports_resolve(code, expression, qualified):
    assert resolve(code, expression) == qualified


@pytest.mark.parametrize(
    ("code", "expression"),
    [
        ("from torch import log\ndef log(x):\n    return x\nlog(y)", "log"),
        ("from torch import log\ndef f(log):\n    return log(y)", "log"),
        ("from torch import log\ndef f():\n    log = print\n    log(y)", "log"),
        ("probs.log()", "probs.log"),
        ("from .utils import log\nlog(x)", "log"),  # relative: the user's own module
    ],
)
def test_locals_and_unknowns_resolve_to_nothing(code, expression):
    assert resolve(code, expression) is None


def test_imports_inside_functions_count_for_the_file():
    code = "def f(x):\n    import torch.nn.functional as F\n    return F.softmax(x)\n"
    assert resolve(code, "F.softmax") == "torch.nn.functional.softmax"


def test_a_class_body_does_not_shadow_its_methods():
    code = (
        "from torch import log\nclass A:\n    log = 1\n    def f(self, x):\n        return log(x)\n"
    )
    assert resolve(code, "log") == "torch.log"


def test_global_declaration_is_not_a_local_binding():
    code = "from torch import log\ndef f(x):\n    global log\n    return log(x)\n"
    assert resolve(code, "log") == "torch.log"


def test_spans_count_characters_not_bytes():
    src = Source("<test>", "s = 'é' ; y = torch.log(p)\n")
    call = next(n for n in src.nodes if isinstance(n, ast.Call))
    span = src.span(call)
    assert (span.column, span.end_column) == (15, 27)
    assert src.line_text(1)[span.column - 1 : span.end_column - 1] == "torch.log(p)"


def test_exclusive_branches():
    src = Source("<test>", "if a:\n    f()\nelse:\n    g()\nh()\n")
    f, g, h = (n for n in src.nodes if isinstance(n, ast.Call))
    assert src.exclusive(f, g)
    assert not src.exclusive(f, h)
    assert not src.exclusive(g, h)


@pytest.mark.parametrize(
    ("code", "expression"),
    [
        ("import jax.nn as F\nF.softmax(x)", "F.softmax"),  # an import of its own wins
        ("F = make_functions()\nF.softmax(x)", "F.softmax"),  # a module-level binding too
        ("def f(nn):\n    return nn.softmax(x)", "nn.softmax"),  # and a parameter
    ],
)
def test_conventional_names_never_override_the_files_own(code, expression):
    assert resolve(code, expression) in (None, "jax.nn.softmax")
