"""Read a checkpoint the safe way and put it into the model, optimizer and scaler.

Two forms are accepted: a model `state_dict`, or `{"model": ..., "optimizer": ...,
"scaler": ..., "step": N}` (all but "model" optional). The file is only ever read, with
`torch.load(weights_only=True)`, which refuses pickled code.
"""

from __future__ import annotations

import contextlib
import inspect
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nandoctor.errors import ConfigError


@dataclass(frozen=True)
class CheckpointState:
    model: Mapping[str, Any]
    optimizer: Mapping[str, Any] | None = None
    scaler: Mapping[str, Any] | None = None
    step: int = 0


def load(path: Path) -> CheckpointState:
    if path.is_dir():
        raise ConfigError(f"checkpoint: {path} is a folder, expected a checkpoint file")
    if path.exists() and not path.is_file():  # NB: /dev/null, a pipe
        raise ConfigError(f"checkpoint: {path} is not a regular file, expected a checkpoint file")
    if not path.is_file():
        raise ConfigError(f"checkpoint: file not found: {path}")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise _refused(path, e) from None
    except Exception as e:  # NB: arbitrary bytes make the unpickler raise almost anything
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"checkpoint: {path} is not a readable torch checkpoint: {first}"
        ) from None
    return _interpret(path, raw)


_UNSAFE_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


def _refused(path: Path, error: pickle.UnpicklingError) -> ConfigError:
    """weights_only refused the file: pickled code in it, or not a checkpoint at all."""
    unsafe = _UNSAFE_GLOBAL.search(str(error))
    if unsafe is None:
        return ConfigError(f"checkpoint: {path} is not a readable torch checkpoint")
    return ConfigError(
        f"checkpoint: {path} holds pickled code or objects ({unsafe.group(1)}), which "
        "torch.load(weights_only=True) refuses to run",
        hint="re-save it as tensors only: torch.save({'model': model.state_dict()}, path)",
    )


def _interpret(path: Path, raw: Any) -> CheckpointState:
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"checkpoint: {path} holds a {type(raw).__name__}, expected a state_dict or a dict"
        )
    if "model" in raw and isinstance(raw["model"], Mapping):
        step = raw.get("step", 0)
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"checkpoint: {path}: 'step' is {step!r}, expected an integer >= 0")
        return CheckpointState(raw["model"], raw.get("optimizer"), raw.get("scaler"), step)
    return CheckpointState(raw)


def restore_model(model: torch.nn.Module, state: CheckpointState) -> None:
    try:
        model.load_state_dict(state.model)
    except (RuntimeError, KeyError, TypeError) as e:
        raise ConfigError(f"checkpoint: does not fit the model: {_first_lines(e)}") from None


def restore_training_state(
    state: CheckpointState, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> None:
    if state.optimizer is not None:
        _require_same_algorithm(state.optimizer, optimizer)
        try:
            optimizer.load_state_dict(dict(state.optimizer))
        except (ValueError, KeyError, RuntimeError, TypeError) as e:
            raise ConfigError(
                f"checkpoint: 'optimizer' does not fit the optimizer: {_first_lines(e)}"
            ) from None
    if state.scaler is not None and scaler is not None:
        scaler.load_state_dict(dict(state.scaler))


def _require_same_algorithm(saved: Mapping[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """torch loads another optimizer's state as long as the group sizes match (Adam's
    into SGD), and the first step then fails on a missing hyperparameter (KeyError
    'momentum', blamed on your code). Groups that hold settings this optimizer does not
    know and lack some it needs come from another algorithm; groups that only lack some
    come from an older torch, which fills them in."""
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or not groups or not isinstance(groups[0], Mapping):
        return  # NB: malformed: load_state_dict says how
    keys = set(groups[0]) - {"params"}
    needed = set(optimizer.defaults)
    # NB: a key of the user's own in the group (a group's "name") is not another algorithm
    foreign = sorted((keys - needed) & _torch_hyperparameters())
    missing = sorted(needed - keys)
    if foreign and missing:
        name = type(optimizer).__name__
        raise ConfigError(
            f"checkpoint: 'optimizer' does not fit the optimizer: it holds {_names(foreign)}, "
            f"which {name} does not take, and lacks {name}'s {_names(missing)}: it was saved "
            "by another optimizer",
            hint="configure the optimizer that saved the checkpoint, or drop its 'optimizer' "
            "entry to start that state afresh",
        )


def _torch_hyperparameters() -> set[str]:
    """Every keyword of torch's own optimizers (betas, momentum, rho, ...)."""
    names: set[str] = set()
    for value in vars(torch.optim).values():
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
            with contextlib.suppress(TypeError, ValueError):
                names |= set(inspect.signature(value).parameters) - {"params", "defaults"}
    return names


def _names(keys: list[str]) -> str:
    quoted = [repr(k) for k in keys[:3]]
    return ", ".join(quoted) + (", ..." if len(keys) > 3 else "")


def _first_lines(error: BaseException, n: int = 2) -> str:
    return " ".join(line.strip() for line in str(error).splitlines()[:n])
