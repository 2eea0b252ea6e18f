"""The run's GradScaler, and the weights it refuses: float16 ones.

A GradScaler multiplies the loss by 65536 and divides the gradients back before the
update; it does that in the gradients' own dtype, so it needs float32 master weights
(autocast computes in float16 from them). PyTorch refuses float16 gradients at the
first `unscale_` ("Attempting to unscale FP16 gradients."); a config is checked before
its first step instead:

    run.yaml:6: precision.grad_scaler: the optimizer's parameters are float16 (4 of 4:
    0.weight, 0.bias, ...) and a GradScaler needs float32 master weights ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nandoctor.errors import ConfigError

if TYPE_CHECKING:  # NB: a type only: the wrappers of a watched process need no pydantic
    from nandoctor.setup.schema import Precision

WHY = (
    "a GradScaler needs float32 master weights (PyTorch refuses to unscale float16 "
    "gradients: multiplied by the loss scale, they overflow float16)"
)
KEEP_FLOAT32 = (
    "keep the parameters in float32 (no .half() or torch.set_default_dtype(torch.float16) "
    "where the model is built) and let autocast cast them to float16"
)
# NB: what PyTorch says (torch/amp/grad_scaler.py, `_unscale_grads_`)
TORCH_MESSAGE = "Attempting to unscale FP16 gradients"


def build_scaler(
    precision: Precision,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
) -> torch.amp.GradScaler | None:
    """The config's GradScaler, or None; checked against the weights before the first step."""
    if not precision.use_grad_scaler:
        return None
    check_master_weights(precision, optimizer, model)
    return torch.amp.GradScaler(device.type, init_scale=precision.init_scale)


def check_master_weights(
    precision: Precision, optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> None:
    """A config error when the optimizer steps float16 parameters, which no GradScaler
    can unscale."""
    found = float16_parameters(optimizer, model)
    if not found:
        return
    scaler = "a GradScaler"
    if precision.grad_scaler is None:
        scaler += " (on by default with float16)"
    raise ConfigError(
        f"precision.grad_scaler: the optimizer's parameters are float16 ({found}), and "
        f"{WHY.replace('a GradScaler', scaler, 1)}; set precision.grad_scaler: false, or "
        f"{KEEP_FLOAT32}"
    )


def float16_parameters(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> str:
    """`3 of 4: 0.weight, 0.bias, 2.weight`: the float16 parameters the optimizer steps,
    by their names in the model; "" when there are none."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    half = [p for p in params if p.dtype == torch.float16]
    if not half:
        return ""
    names = {id(p): name for name, p in model.named_parameters()}
    shown = [names.get(id(p), "?") for p in half[:3]]
    more = ", ..." if len(half) > 3 else ""
    return f"{len(half)} of {len(params)}: {', '.join(shown)}{more}"


def explain_float16_unscale(error: BaseException) -> None:
    """Add the why and the ways out to PyTorch's own error, raised in a user's loop (a
    `Guard`, `watch`): the error stays theirs, the traceback shows the note (Python 3.11+)."""
    if TORCH_MESSAGE not in str(error) or not hasattr(error, "add_note"):
        return
    if any(n.startswith("nandoctor:") for n in getattr(error, "__notes__", ())):
        return  # NB: step() calls unscale_(): told once
    error.add_note(
        f"nandoctor: the parameters this optimizer steps are float16, and {WHY}: "
        f"{KEEP_FLOAT32}, or build the GradScaler with enabled=False"
    )
