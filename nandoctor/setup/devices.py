"""Which device a run uses, and whether it can autocast to the asked dtype there."""

from __future__ import annotations

import torch

from nandoctor.errors import ConfigError


def cpu_autocast_note(dtype: str = "float16 or bfloat16") -> str:
    """The note of a run that autocasts with the CPU's own lists (`dtype`: the run's)."""
    return (
        f"CPU autocast casts fewer ops than CUDA autocast (softmax stays in {dtype} on the "
        "CPU, float32 on CUDA), so numerics differ from a GPU run"
    )


def resolve_device(name: str) -> torch.device:
    """`auto` is the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device: '{name}' asked for, but torch.cuda.is_available() is False",
                hint="use device: auto or cpu, or install a CUDA build of torch",
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"device: '{name}' asked for, but only {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def check_dtype_supported(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a dtype the device cannot autocast to, before any step runs."""
    if dtype == torch.float32:
        return
    if device.type == "cuda" and dtype == torch.bfloat16 and not _cuda_bf16(device):
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"precision.dtype: bfloat16 is not supported on {name} (needs compute capability 8.0+)",
            hint="use float16 with a GradScaler, or float32",
        )
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError(f"precision.dtype: torch cannot autocast on device type {device.type}")


def _cuda_bf16(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported()
