"""Math patches rewrite exactly the pattern they name, count it, and leave the rest."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from nandoctor.causes import catalog
from nandoctor.localize.modes import NodeRecorder
from nandoctor.registry import DuplicateError
from nandoctor.runtime import safe_ops, wrappers
from nandoctor.runtime.patches import (
    PATCHES,
    EpsilonPatch,
    FiniteMaskPatch,
    LogSoftmaxPatch,
    MathPatch,
    OpSite,
    OriginGuardPatch,
    patch_for,
)
from nandoctor.runtime.safe_ops import SafeForm

_TENSOR_SOFTMAX = torch.Tensor.softmax


def test_log_of_softmax_becomes_log_softmax_in_every_spelling():
    x = torch.tensor([[0.0, 30.0, -30.0]], dtype=torch.float16)
    with LogSoftmaxPatch() as patch:
        a = torch.log(torch.softmax(x, -1))  # nandoctor: ignore[log-of-softmax]
        b = F.softmax(x, dim=-1).log()  # nandoctor: ignore[log-of-softmax]
        c = torch.log(x.softmax(-1))  # nandoctor: ignore[log-of-softmax]
    for y in (a, b, c):
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, F.log_softmax(x, -1))
    assert patch.hits == 3


def test_log_of_softmax_is_rewritten_while_the_forecast_wraps_softmax_in_torch():
    """The forecast's listener wraps `torch.Tensor.softmax` (and log) in torch, and torch
    hands a mode the method as it finds it: the wrapper. The patch found nothing to rewrite
    and the log-of-softmax fix went unverified whenever a listener was on."""

    class Listener:
        def softmax_called(self, op, x, dim, out):
            pass

        def attention_called(self, args, kwargs):
            pass

        def log_called(self, x):
            pass

    x = torch.tensor([[0.0, 30.0, -30.0]], dtype=torch.float16)
    listener = Listener()
    wrappers.listen_softmaxes(listener)
    try:
        assert torch.Tensor.softmax is not _TENSOR_SOFTMAX  # the wrapper is on
        with LogSoftmaxPatch() as patch:
            y = F.softmax(x, dim=-1).log()  # nandoctor: ignore[log-of-softmax]
            z = torch.log(x.softmax(-1))  # nandoctor: ignore[log-of-softmax]
    finally:
        wrappers.stop_listening_softmaxes(listener)
    assert patch.hits == 2
    torch.testing.assert_close(y, F.log_softmax(x, -1))
    torch.testing.assert_close(z, F.log_softmax(x, -1))


def test_log_of_something_else_is_left_alone():
    p = torch.tensor([0.5, 0.0])
    with LogSoftmaxPatch() as patch:
        assert torch.log(p)[1] == float("-inf")
    assert patch.hits == 0


def test_a_softmax_inside_a_library_is_not_rewritten(tmp_path, monkeypatch):
    """transformers' attention makes the probabilities, the user's loss takes their log:
    the user holds no logits to pass to log_softmax, so that is no fix to verify (the
    guard of the user's log is)."""
    library = tmp_path / "site-packages" / "attention_lib.py"
    library.parent.mkdir()
    library.write_text("import torch\ndef attend(x):\n    return torch.softmax(x, -1)\n")
    monkeypatch.syspath_prepend(str(library.parent))
    from attention_lib import attend

    x = torch.tensor([[0.0, 200.0]])
    with LogSoftmaxPatch() as patch:
        y = torch.log(attend(x))  # nandoctor: ignore[log-of-softmax]
    assert patch.hits == 0 and y[0, 0] == float("-inf")


def test_a_fully_masked_row_stays_finite_with_a_finite_minimum():
    scores = torch.randn(2, 3)
    mask = torch.tensor([[True, True, True], [False, True, False]])
    with FiniteMaskPatch() as patch:
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), -1)  # nandoctor: ignore
    assert torch.isfinite(probs).all() and patch.hits == 1
    assert probs[1, 1] == 0  # a partly masked row is unchanged


def test_an_epsilon_float16_rounds_to_zero_is_raised():
    x = torch.zeros(4, dtype=torch.float16)
    with EpsilonPatch() as patch:
        y = x / torch.sqrt(x.pow(2).mean() + 1e-8)
        z = F.layer_norm(torch.zeros(2, 4, dtype=torch.float16), (4,), eps=1e-9)
        w = x / x.abs().clamp(min=1e-8)
    assert torch.isfinite(y).all() and torch.isfinite(z).all() and torch.isfinite(w).all()
    assert patch.hits == 3


def test_an_epsilon_given_as_a_tensor_is_raised_too():
    """A float32 buffer in a float16 sum, a floor of one element, a fill, a `where`."""
    x = torch.zeros(2, 4, dtype=torch.float16)
    n = x.norm(dim=-1, keepdim=True)
    eps = torch.tensor(1e-8)  # a buffer's: float32, one element, no grad
    with EpsilonPatch() as patch:
        outs = [
            x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps),
            x / torch.maximum(n, eps),
            x / torch.max(n, torch.full_like(n, 1e-8)),
            x / torch.where(n > 1e-8, n, 1e-8),
            x / n.clamp_min(eps),
        ]
    assert all(bool(torch.isfinite(y).all()) for y in outs) and patch.hits == 5


def test_a_weight_or_a_reduction_is_no_epsilon():
    x = torch.zeros(4, dtype=torch.float16)
    scale = torch.tensor(1e-8, requires_grad=True)  # a learnable scale, not a constant
    with EpsilonPatch() as patch:
        x + scale
        torch.max(x, 0)  # a reduction over a dim
        torch.full_like(x, 0.0)
    assert patch.hits == 0


def test_an_epsilon_the_dtype_holds_is_left_alone():
    with EpsilonPatch() as patch:
        torch.zeros(4) + 1e-8  # float32 holds 1e-8
        torch.zeros(4, dtype=torch.float16) + 1e-3
    assert patch.hits == 0


def test_patches_are_registered_by_cause_id_once():
    assert {
        "log-of-softmax": LogSoftmaxPatch,
        "fully-masked-softmax": FiniteMaskPatch,
        "eps-underflow": EpsilonPatch,
    } == PATCHES
    for cause_id in PATCHES:
        catalog.get(cause_id)

    class AnotherLogSoftmax(MathPatch):
        describe = "a second rewrite of log(softmax(x))"

    first = r"first by nandoctor\.runtime\.patches\.LogSoftmaxPatch, again by .*AnotherLogSoftmax"
    with pytest.raises(DuplicateError, match=first):
        patch_for("log-of-softmax")(AnotherLogSoftmax)
    assert PATCHES["log-of-softmax"] is LogSoftmaxPatch


# -- guard the origin op ----------------------------------------------------------------
USER_PY = """
import torch


def normalise(x, y):
    a = x / y
    b = x / y
    return a, b


def distance(a, b):
    return torch.sqrt(((a - b) ** 2).sum(-1)).sum()


def angle(c):
    return torch.acos(c)


def logs(p):
    return torch.log(p), p.log()


def softplus_ish(z):
    return torch.exp(z)


def scaled(scale, sims):
    return scale.exp() * sims


def masked_lm(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels)


class Amplify(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1000

    @staticmethod
    def backward(ctx, g):
        return g * 1000


def amplify(x):
    return Amplify.apply(x)
"""


@pytest.fixture
def user(tmp_path):
    """The module above, loaded from a file of the user's, and where each line is."""
    path = tmp_path / "user_math.py"
    path.write_text(USER_PY)
    spec = importlib.util.spec_from_file_location("user_math", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = USER_PY.splitlines()

    def site(snippet: str, family: str, overflowed: bool = False) -> OpSite:
        (line,) = [i + 1 for i, text in enumerate(lines) if snippet in text]
        return OpSite(family, os.path.realpath(path), line, overflowed)

    module.site = site
    return module


def test_the_guard_makes_only_that_op_at_that_line_safe(user):
    x, y = torch.zeros(3), torch.zeros(3)
    with OriginGuardPatch(user.site("a = x / y", "div")) as patch:
        a, b = user.normalise(x, y)
    assert torch.equal(a, torch.zeros(3)) and b.isnan().all()  # line b: as written
    assert patch.hits == 1
    assert patch.describe == "the div at user_math.py:6 guarded (denominator moved away from 0)"


def test_a_guarded_sqrt_has_a_finite_backward_at_zero(user):
    a = torch.zeros(4, 2, requires_grad=True)
    user.distance(a, torch.zeros(4, 2)).backward()
    assert a.grad.isnan().all()  # the failure: inf * 0 in the backward of sqrt
    a.grad = None
    with OriginGuardPatch(user.site("torch.sqrt(", "sqrt")) as patch:
        user.distance(a, torch.zeros(4, 2)).backward()
    assert torch.isfinite(a.grad).all() and patch.hits == 1


def test_acos_is_clamped_inside_its_domain_and_log_above_zero(user):
    c = torch.tensor([1.0000001, -1.0, 0.5], requires_grad=True)
    with OriginGuardPatch(user.site("torch.acos(", "acos")):
        out = user.angle(c)
        out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(c.grad).all()
    assert out[2] == torch.acos(torch.tensor(0.5))  # inside the domain: unchanged
    p = torch.tensor([0.0, -1.0, 0.5], dtype=torch.float16)
    with OriginGuardPatch(user.site("torch.log(p)", "log")) as patch:
        guarded, other = user.logs(p)  # both calls are on the line: both are guarded
    assert torch.isfinite(guarded).all() and torch.isfinite(other).all() and patch.hits == 2
    assert guarded[0] == torch.log(torch.tensor(torch.finfo(torch.float16).tiny, dtype=p.dtype))


def test_an_overflowing_exp_runs_in_float32(user):
    z = torch.full((2,), 12.0, dtype=torch.float16)
    assert user.softplus_ish(z).isinf().all()  # e^12 > 65504
    with OriginGuardPatch(user.site("torch.exp(", "exp")) as patch:
        out = user.softplus_ish(z)
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and patch.hits == 1


def test_a_matmul_that_did_not_overflow_is_not_run_in_float32():
    """float32 is a guard against overflow; for a NaN out of the math it changes nothing."""
    assert not OriginGuardPatch(OpSite("matmul", "/x.py", 1, overflowed=False)).float32
    assert OriginGuardPatch(OpSite("matmul", "/x.py", 1, overflowed=True)).float32
    assert OriginGuardPatch(OpSite("exp", "/x.py", 1)).float32


def test_a_custom_autograd_function_at_the_line_runs_in_float32(user):
    apply = torch.autograd.Function.__dict__["apply"]
    x = torch.full((3,), 100.0, dtype=torch.float16, requires_grad=True)
    assert user.amplify(x).isinf().all()  # 100000 > 65504
    with OriginGuardPatch(user.site("Amplify.apply(x)", "Amplify", overflowed=True)) as patch:
        out = user.amplify(x)
        out.sum().backward()
    assert out.dtype == torch.float32 and torch.isfinite(out).all() and patch.hits == 1
    assert torch.autograd.Function.__dict__["apply"] is apply  # put back on exit
    assert user.amplify(x).dtype == torch.float16


class Notes:
    """What the tracer's `NodeRecorder` tells its tracer: what made each autograd node."""

    def __init__(self) -> None:
        self.made_by: list = []

    def watching(self) -> bool:
        return True

    def note_node(self, node, made_by) -> None:
        self.made_by.append(made_by)


@pytest.mark.parametrize("outer", ["guard", "tracer"])
def test_the_guard_and_the_tracer_share_function_apply_nested_either_way(user, outer):
    """Both wrap a custom Function's `apply` (the guard runs it in float32, the tracer notes
    the node it made), through the one wrapper of runtime/wrappers.py: nested either way,
    each sees every apply while it is on, and torch's own `apply` is back, the very object,
    once both have left."""
    apply = torch.autograd.Function.__dict__["apply"]
    x = torch.full((3,), 100.0, dtype=torch.float16, requires_grad=True)
    guard = OriginGuardPatch(user.site("Amplify.apply(x)", "Amplify", overflowed=True))
    tracer = Notes()
    recorder = NodeRecorder(tracer)
    first, second = (guard, recorder) if outer == "guard" else (recorder, guard)
    with first:
        with second:
            both = user.amplify(x)
        alone = user.amplify(x)
    assert torch.autograd.Function.__dict__["apply"] is apply
    noted = [made_by for made_by in tracer.made_by if made_by is user.Amplify]
    assert both.dtype == torch.float32
    if outer == "guard":
        assert alone.dtype == torch.float32 and guard.hits == 2 and len(noted) == 1
    else:
        assert alone.dtype == torch.float16 and guard.hits == 1 and len(noted) == 2


@pytest.mark.parametrize(
    ("name", "family", "kind"),
    [
        ("aten.div.Tensor", "div", SafeForm.DENOMINATOR),
        ("torch.Tensor.__rtruediv__", "div", SafeForm.SELF_AWAY),
        ("torch.Tensor.div_", "div", SafeForm.DENOMINATOR),
        ("aten.log.default", "log", SafeForm.FLOOR),
        ("torch.sqrt", "sqrt", SafeForm.FLOOR),
        ("torch.arccos", "acos", SafeForm.UNIT),
        ("torch.Tensor.__pow__", "pow", SafeForm.POW),
        ("torch.nn.functional.linear", "matmul", SafeForm.FLOAT32),
        ("aten.addmm.default", "matmul", SafeForm.FLOAT32),
        ("aten.exp.default", "exp", SafeForm.FLOAT32),
        ("aten.nll_loss_forward.default", "nll_loss", SafeForm.MEAN_OVER_NONE),
        ("torch.nn.functional.cross_entropy", "nll_loss", SafeForm.MEAN_OVER_NONE),
    ],
)
def test_ops_are_known_by_their_family(name, family, kind):
    assert safe_ops.family(name) == (family, kind)


def test_a_root_floors_its_base_and_a_negative_power_keeps_it_off_zero():
    x = torch.zeros(3, requires_grad=True)
    y = safe_ops.safe_call(torch.pow, "torch.pow", (x, 0.5), {})
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.isfinite(safe_ops.safe_call(torch.pow, "torch.pow", (x, -2), {})).all()
    assert safe_ops.away_from_zero(torch.tensor([0.0, -1e-9, 2.0])).tolist() == [
        torch.finfo(torch.float32).eps,
        -torch.finfo(torch.float32).eps,
        2.0,
    ]


def test_xlogys_second_input_is_floored_so_its_gradient_at_0_over_0_is_finite():
    p = torch.tensor([0.0, 0.5], requires_grad=True)
    assert safe_ops.family("torch.xlogy") == ("xlogy", safe_ops.SafeForm.OTHER_FLOOR)
    safe_ops.safe_call(torch.xlogy, "torch.xlogy", (p, p), {}).sum().backward()
    assert torch.isfinite(p.grad).all()  # torch.xlogy(p, p) itself: NaN at 0


def test_a_mean_over_no_target_is_0_and_any_other_mean_is_as_it_was(user):
    """A masked-LM batch with nothing masked: every label is ignore_index, and the mean
    cross-entropy over none is 0/0. Guarded, it is the sum over the targets counted (at
    least 1): 0 with zero gradients, and the mean itself wherever a target is left."""
    logits = torch.randn(6, 5, requires_grad=True)
    none = torch.full((6,), -100)
    assert user.masked_lm(logits, none).isnan()
    site = user.site("cross_entropy(logits, labels)", "nll_loss")
    with OriginGuardPatch(site) as patch:
        loss = user.masked_lm(logits, none)
        loss.backward()
        some = torch.tensor([1, -100, 3, -100, 0, 2])
        kept = user.masked_lm(logits, some)
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros(6, 5)) and patch.hits == 2
    torch.testing.assert_close(kept, torch.nn.functional.cross_entropy(logits, some))
    assert patch.describe.endswith("guarded (a mean over no target taken as 0)")
    weight = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])
    weighted = safe_ops.mean_over_some(
        torch.nn.functional.cross_entropy, (logits, some), {"weight": weight}
    )
    plain = torch.nn.functional.cross_entropy(logits, some, weight=weight)
    torch.testing.assert_close(weighted, plain)


def test_an_exp_of_a_learnable_scale_is_capped_where_clip_caps_it(user):
    """float32 bounds no exponent past 88.7: CLIP's logit scale is capped at ln(100)."""
    scale = torch.nn.Parameter(torch.tensor(91.8))
    sims = torch.tensor([0.5, -0.25])
    assert user.scaled(scale, sims).isinf().all()
    site = replace(user.site("scale.exp()", "exp", overflowed=True), scale=True)
    with OriginGuardPatch(site) as patch:
        capped = user.scaled(scale, sims)
        capped.sum().backward()
        others = user.scaled(torch.tensor([1.0, 2.0]), sims)  # no learnable scale: float32
    torch.testing.assert_close(capped, 100.0 * sims)
    assert scale.grad == 0.0 and torch.isfinite(others).all() and patch.hits == 2
    assert patch.describe.endswith(
        "guarded (its learnable scale capped at ln(100), as CLIP caps its logit scale)"
    )


LIBRARY_PY = """
def normalise(x, y):
    return x / y
"""


def test_an_op_inside_a_library_is_guarded_at_the_librarys_line_only(tmp_path, user):
    """The user's `model(x)` line runs every op of the model: the guard keys on the
    library line the report shows, so the user's own division stays as written."""
    package = tmp_path / "site-packages" / "fakelib"
    package.mkdir(parents=True)
    (package / "ops.py").write_text(LIBRARY_PY)
    spec = importlib.util.spec_from_file_location("fakelib_ops", package / "ops.py")
    library = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(library)
    x, y = torch.zeros(3), torch.zeros(3)
    site = OpSite("div", "fakelib/ops.py", 3, library=True)
    with OriginGuardPatch(site) as patch:
        inside = library.normalise(x, y)
        mine, _ = user.normalise(x, y)
    assert torch.equal(inside, torch.zeros(3)) and mine.isnan().all() and patch.hits == 1
