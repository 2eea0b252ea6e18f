"""The few GradScaler internals nandoctor touches, kept in one place.

`GradScaler.state_dict()` and `get_scale()` read the scale with `.item()`, a host sync;
on the fast path we read and copy the scale tensor itself instead. These attributes
(`_scale`, `_growth_tracker`, `_per_optimizer_states`) have been stable since torch 1.6.
"""

from __future__ import annotations

import torch

ScalerState = tuple[torch.Tensor | None, torch.Tensor | None]


def scale_tensor(scaler: torch.amp.GradScaler | None) -> torch.Tensor | None:
    """The scale as a device tensor (None before the first step or without a scaler)."""
    return getattr(scaler, "_scale", None) if scaler is not None else None


def capture(scaler: torch.amp.GradScaler | None) -> ScalerState | None:
    if scaler is None:
        return None
    scale, tracker = scale_tensor(scaler), getattr(scaler, "_growth_tracker", None)
    return (
        scale.detach().clone() if scale is not None else None,
        tracker.detach().clone() if tracker is not None else None,
    )


def restore(scaler: torch.amp.GradScaler | None, state: ScalerState | None) -> None:
    if scaler is None or state is None:
        return
    scale, tracker = state
    scaler._scale = scale.clone() if scale is not None else None
    scaler._growth_tracker = tracker.clone() if tracker is not None else None
    scaler._per_optimizer_states.clear()


def set_scale(scaler: torch.amp.GradScaler, value: float, device: torch.device) -> None:
    """Force the next step's loss scale (a replay at the scale a streak collapsed to)."""
    scale = scale_tensor(scaler)
    if scale is None:
        scaler._scale = torch.full((), value, dtype=torch.float32, device=device)
        scaler._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
    else:
        scale.fill_(value)
