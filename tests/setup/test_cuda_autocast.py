"""CUDA's autocast policy on the CPU: every op of CUDA's lists computes in the dtype CUDA
autocast gives it, for float16 and bfloat16; outside the emulation, CPU autocast is
untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nandoctor.setup.autocast_lists import BANNED, FP32_APPEND_DTYPE, POLICY
from nandoctor.setup.cuda_autocast import emulated, is_emulating, overload
from tests.helpers.paths import CONFIGS

LOW = [torch.float16, torch.bfloat16]
# Kernels that exist only in CUDA builds: registered, but no CPU tensor can reach them.
CUDA_ONLY = {
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "_scaled_dot_product_flash_attention",
}


def _f(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) * 0.8 + 0.1  # float32, in (0.1, 0.9): every op's domain


def _cell(chunks: int, lstm: bool = False) -> tuple:
    x, h = _f(4, 8), _f(4, 8)
    hx = (h, _f(4, 8)) if lstm else h
    return (x, hx, _f(chunks * 8, 8), _f(chunks * 8, 8), _f(chunks * 8), _f(chunks * 8))


def _conv(dims: int) -> tuple:
    return _f(2, 3, *[6] * dims), _f(4, 3, *[3] * dims)


def _t(dims: int) -> tuple:
    return (_f(2, 3, *[4] * dims),)


ONES, TARGET = torch.ones(8), torch.tensor([1, 0, 3, 2, 7, 5, 6, 4])
CONV_ARGS = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)

# op -> its arguments (float32 inputs; the test casts them to the dtype the list takes in)
ARGS = {
    "_convolution.deprecated": lambda: (*_conv(2), None, *CONV_ARGS, False, False, True),
    "_convolution": lambda: (*_conv(2), None, *CONV_ARGS, False, False, True, True),
    "conv1d": lambda: _conv(1),
    "conv2d": lambda: _conv(2),
    "conv3d": lambda: _conv(3),
    "conv_tbc": lambda: (_f(6, 2, 3), _f(3, 3, 4), _f(4)),
    "conv_transpose1d": lambda: (_f(2, 4, 6), _f(4, 3, 3)),
    "conv_transpose2d.input": lambda: (_f(2, 4, 6, 6), _f(4, 3, 3, 3)),
    "conv_transpose3d.input": lambda: (_f(2, 4, 6, 6, 6), _f(4, 3, 3, 3, 3)),
    "convolution": lambda: (*_conv(2), None, *CONV_ARGS),
    "prelu": lambda: (_f(8, 8), torch.tensor([0.25])),
    "addmm": lambda: (_f(8, 8), _f(8, 8), _f(8, 8)),
    "addmv": lambda: (_f(8), _f(8, 8), _f(8)),
    "addr": lambda: (_f(8, 8), _f(8), _f(8)),
    "matmul": lambda: (_f(8, 8), _f(8, 8)),
    "einsum": lambda: ("ij,jk->ik", [_f(8, 8), _f(8, 8)]),
    "mm": lambda: (_f(8, 8), _f(8, 8)),
    "mv": lambda: (_f(8, 8), _f(8)),
    "linalg_vecdot": lambda: (_f(8, 8), _f(8, 8)),
    "linear": lambda: (_f(8, 8), _f(4, 8), _f(4)),
    "addbmm": lambda: (_f(8, 8), _f(2, 8, 8), _f(2, 8, 8)),
    "baddbmm": lambda: (_f(2, 8, 8), _f(2, 8, 8), _f(2, 8, 8)),
    "bmm": lambda: (_f(2, 8, 8), _f(2, 8, 8)),
    "chain_matmul": lambda: ([_f(8, 8), _f(8, 8), _f(8, 8)],),
    "linalg_multi_dot": lambda: ([_f(8, 8), _f(8, 8), _f(8, 8)],),
    "lstm_cell": lambda: _cell(4, lstm=True),
    "gru_cell": lambda: _cell(3),
    "rnn_tanh_cell": lambda: _cell(1),
    "rnn_relu_cell": lambda: _cell(1),
    "scaled_dot_product_attention": lambda: (_f(2, 4, 8), _f(2, 4, 8), _f(2, 4, 8)),
    **{
        name: lambda: (_f(8, 8),)
        for name in [
            "acos",
            "asin",
            "cosh",
            "erfinv",
            "exp",
            "expm1",
            "log",
            "log10",
            "log2",
            "log1p",
            "reciprocal",
            "rsqrt",
            "sinh",
            "tan",
            "softplus",
            "nuclear_norm",
            "pdist",
            "prod",
            "sum",
        ]
    },
    "pow.Tensor_Scalar": lambda: (_f(8, 8), 2),
    "pow.Tensor_Tensor": lambda: (_f(8, 8), _f(8, 8)),
    "pow.Scalar": lambda: (2.0, _f(8, 8)),
    "layer_norm": lambda: (_f(4, 8), [8]),
    "native_layer_norm": lambda: (_f(4, 8), [8], None, None, 1e-5),
    "group_norm": lambda: (_f(2, 4, 3), 2),
    "rms_norm": lambda: (_f(4, 8), [8]),
    "frobenius_norm.dim": lambda: (_f(8, 8), [0, 1]),
    "nuclear_norm.dim": lambda: (_f(8, 8), [0, 1]),
    "cosine_similarity": lambda: (_f(8, 8), _f(8, 8)),
    "poisson_nll_loss": lambda: (_f(8), _f(8), True, False, 1e-8, 1),
    "cosine_embedding_loss": lambda: (_f(8, 8), _f(8, 8), ONES),
    "nll_loss": lambda: (_f(8, 8), TARGET),
    "nll_loss2d": lambda: (_f(2, 3, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long)),
    "hinge_embedding_loss": lambda: (_f(8), ONES),
    "kl_div": lambda: (_f(8), _f(8)),
    "l1_loss": lambda: (_f(8), _f(8)),
    "smooth_l1_loss": lambda: (_f(8), _f(8)),
    "huber_loss": lambda: (_f(8), _f(8)),
    "mse_loss": lambda: (_f(8), _f(8)),
    "margin_ranking_loss": lambda: (_f(8), _f(8), ONES),
    "multilabel_margin_loss": lambda: (_f(8, 8), torch.zeros(8, 8, dtype=torch.long)),
    "soft_margin_loss": lambda: (_f(8), ONES),
    "triplet_margin_loss": lambda: (_f(8, 8), _f(8, 8), _f(8, 8)),
    "multi_margin_loss": lambda: (_f(8, 8), TARGET),
    "binary_cross_entropy_with_logits": lambda: (_f(8), _f(8)),
    "dist": lambda: (_f(8), _f(8)),
    "cdist": lambda: (_f(4, 8), _f(4, 8)),
    "renorm": lambda: (_f(8, 8), 2, 0, 1.0),
    "logsumexp": lambda: (_f(8, 8), [1]),
    "upsample_nearest1d": lambda: (*_t(1), [8]),
    "_upsample_nearest_exact1d": lambda: (*_t(1), [8]),
    "upsample_nearest2d": lambda: (*_t(2), [8, 8]),
    "_upsample_nearest_exact2d": lambda: (*_t(2), [8, 8]),
    "upsample_nearest3d": lambda: (*_t(3), [8, 8, 8]),
    "_upsample_nearest_exact3d": lambda: (*_t(3), [8, 8, 8]),
    "upsample_linear1d": lambda: (*_t(1), [8], False),
    "upsample_bilinear2d": lambda: (*_t(2), [8, 8], False),
    "_upsample_bilinear2d_aa": lambda: (*_t(2), [2, 2], False),
    "upsample_trilinear3d": lambda: (*_t(3), [8, 8, 8], False),
    "upsample_bicubic2d": lambda: (*_t(2), [8, 8], False),
    "_upsample_bicubic2d_aa": lambda: (*_t(2), [2, 2], False),
    "prod.dim_int": lambda: (_f(8, 8), 0),
    "softmax.int": lambda: (_f(8, 8), -1),
    "log_softmax.int": lambda: (_f(8, 8), -1),
    "cumprod": lambda: (_f(8, 8), 0),
    "cumsum": lambda: (_f(8, 8), 0),
    "linalg_vector_norm": lambda: (_f(8, 8),),
    "linalg_matrix_norm": lambda: (_f(8, 8), 1),
    "linalg_matrix_norm.str_ord": lambda: (_f(8, 8),),
    "sum.dim_IntList": lambda: (_f(8, 8), [0]),
    "norm.Scalar": lambda: (_f(8, 8),),
    "norm.ScalarOpt_dim": lambda: (_f(8, 8), 2, [0]),
    "addcdiv": lambda: (_f(8), _f(8), _f(8)),
    "addcmul": lambda: (_f(8), _f(8), _f(8)),
    "atan2": lambda: (_f(8), _f(8)),
    "bilinear": lambda: (_f(2, 3), _f(2, 4), _f(5, 3, 4), _f(5)),
    "cross": lambda: (_f(4, 3), _f(4, 3), 1),
    "dot": lambda: (_f(8), _f(8)),
    "vdot": lambda: (_f(8), _f(8)),
    "grid_sampler": lambda: (_f(1, 2, 4, 4), _f(1, 3, 3, 2), 0, 0, False),
    "index_put": lambda: (_f(8), (torch.tensor([1, 3]),), _f(2)),
    "tensordot": lambda: (_f(2, 3, 4), _f(3, 4, 5), [1, 2], [0, 1]),
    "scatter_add": lambda: (_f(2, 4), 1, torch.tensor([[0, 1], [2, 3]]), _f(2, 2)),
}


def _cast(value, dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _out_dtype(name: str, args: tuple, low: torch.dtype) -> torch.dtype:
    with emulated(), torch.autocast("cpu", low):
        out = overload(name)(*args)
    return (out[0] if isinstance(out, tuple) else out).dtype


def test_the_lists_are_exactly_the_ops_the_installed_torch_casts_on_cuda():
    registered = {
        n.removeprefix("aten::")
        for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
        if n.startswith("aten::")
    }
    assert set(POLICY) == registered


def test_every_op_of_the_lists_has_a_case_here():
    assert set(POLICY) - set(BANNED) - CUDA_ONLY == set(ARGS)
    assert all(
        not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{n}", "CPU") for n in CUDA_ONLY
    )


@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(ARGS))
def test_each_op_computes_in_the_dtype_cuda_autocast_gives_it(name, low):
    policy = POLICY[name]
    if policy == "lower_precision_fp":  # float32 in, the autocast dtype out
        args, expected = ARGS[name](), low
    elif policy == "promote":  # mixed in: the widest; all low in: low
        args = _cast(ARGS[name](), low)
        assert _out_dtype(name, args, low) == low
        mixed = list(args)
        mixed[0] = mixed[0].float()
        args, expected = tuple(mixed), torch.float32
    else:  # fp32, fp32_set_opt_dtype, fp32_append_dtype: low in, float32 out
        args, expected = _cast(ARGS[name](), low), torch.float32
    assert _out_dtype(name, args, low) == expected


@pytest.mark.parametrize("low", LOW, ids=str)
def test_an_explicit_dtype_is_respected_as_cuda_does(low):
    x = _f(8, 8).to(low)
    with emulated(), torch.autocast("cpu", low):
        assert torch.sum(x, dtype=low).dtype == low
        assert torch.softmax(x, -1, dtype=torch.float64).dtype == torch.float64
        assert torch.sum(x.double()).dtype == torch.float64  # float64 is never cast


def test_ops_cpu_autocast_casts_and_cuda_does_not_are_left_alone():
    a, b = _f(4).bfloat16(), _f(4)
    with emulated(), torch.autocast("cpu", torch.bfloat16):
        assert torch.cat([a, b]).dtype == torch.float32  # type promotion, no autocast
        assert torch.linalg.inv(_f(4, 4).bfloat16() + 4 * torch.eye(4)).dtype == torch.float32
    # CPU autocast casts fft to float32; CUDA's does not, so bfloat16 stays (and is refused)
    with emulated(), torch.autocast("cpu", torch.bfloat16), pytest.raises(RuntimeError):
        torch.fft.fft(_f(8).bfloat16())


def test_binary_cross_entropy_is_refused_as_cuda_autocast_refuses_it():
    with (
        emulated(),
        torch.autocast("cpu", torch.float16),
        pytest.raises(RuntimeError, match="unsafe"),
    ):
        F.binary_cross_entropy(_f(8), _f(8))


def test_gradients_flow_through_the_casts():
    w = _f(8, 8).requires_grad_()
    with emulated(), torch.autocast("cpu", torch.float16):
        loss = torch.log(torch.softmax(w.half() * 2, -1)).sum()
    assert loss.dtype == torch.float32
    loss.backward()
    assert w.grad is not None and w.grad.dtype == torch.float32


def test_the_emulation_is_removed_on_exit_and_nests():
    x = _f(8).half()
    with emulated():
        with emulated():
            assert is_emulating()
        with torch.autocast("cpu", torch.float16):
            assert torch.exp(x).dtype == torch.float32  # the outer user still holds it
    assert not is_emulating()
    with torch.autocast("cpu", torch.float16):
        assert torch.exp(x).dtype == torch.float16  # CPU autocast's own policy again
        assert torch.mm(_f(8, 8), _f(8, 8)).dtype == torch.float16


def test_the_emulation_is_removed_when_the_body_raises():
    with pytest.raises(ValueError), emulated():
        raise ValueError("boom")
    assert not is_emulating()


def test_append_dtype_twins_exist():
    for name, twin in FP32_APPEND_DTYPE.items():
        assert overload(twin)._schema.arguments[-1].name == "dtype", name


# -- on a CUDA machine: the emulation against CUDA's own autocast ---------------------
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
EXAMPLES = sorted(p.name for p in CONFIGS.glob("*.yaml"))


@pytest.mark.cuda
@NEEDS_CUDA
@pytest.mark.parametrize("low", LOW, ids=str)
@pytest.mark.parametrize("name", sorted(ARGS))
def test_each_op_matches_real_cuda_autocast(name, low):
    if low == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("bfloat16 needs compute capability 8.0+")
    lower = POLICY[name] == "lower_precision_fp"
    args = ARGS[name]() if lower else _cast(ARGS[name](), low)
    with torch.autocast("cuda", low):
        out = overload(name)(*_to(args, "cuda"))
    assert _out_dtype(name, args, low) == (out[0] if isinstance(out, tuple) else out).dtype


@pytest.mark.cuda
@NEEDS_CUDA
@pytest.mark.parametrize("config", EXAMPLES)
def test_each_op_of_a_shipped_example_gets_cudas_dtype(config):
    """One forward and loss of each shipped example on the GPU and, emulated, on the CPU:
    every op both devices ran produced the same output dtypes."""
    seen = {device: _op_dtypes(CONFIGS / config, device) for device in ("cpu", "cuda")}
    common = seen["cpu"].keys() & seen["cuda"].keys()
    assert common
    assert {op: seen["cpu"][op] for op in common} == {op: seen["cuda"][op] for op in common}


def _op_dtypes(config, device: str) -> dict[str, set[torch.dtype]]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from nandoctor.runtime.tensors import to_device
    from nandoctor.setup.load import load_config
    from nandoctor.setup.session import build_session

    seen: dict[str, set[torch.dtype]] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    seen.setdefault(str(func), set()).add(t.dtype)
            return out

    loaded = load_config(config).with_overrides(device=device, autocast_policy="cuda")
    session = build_session(loaded)
    _, batch = next(iter(session.batches))
    batch = to_device(batch, session.device)
    with Record(), session.autocast():
        session.loss_fn(session.train_model or session.model, batch)
    return seen


def _to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value
