"""The run's settings and environment as the hooks discovered them, for the report and
the rules (`diagnose` reads the same from its config and session)."""

from __future__ import annotations

import torch

from nandoctor.causes.case import RunFacts
from nandoctor.report.types import Environment
from nandoctor.runtime.fast_run import RunResult
from nandoctor.runtime.hooked import HookedRun
from nandoctor.runtime.probe import Phase


def environment_of(run: HookedRun) -> Environment:
    return Environment(
        device=str(run.device or "cpu"),
        torch=torch.__version__,
        dtype=_name(run.dtype) or "float32",
        grad_scaler=run.scaler is not None,
        threads=torch.get_num_threads(),
    )


def facts_of(run: HookedRun, result: RunResult) -> RunFacts:
    """The settings the rules read, as the run used them (the optimizer's current lr)."""
    failure = result.failure
    collapsed = (
        failure is not None
        and failure.phase is Phase.BACKWARD
        and failure.reading.scale is not None
    )
    group = run.optimizer.param_groups[0] if run.optimizer is not None else {}
    params = run.params
    return RunFacts(
        dtype=_name(run.dtype) or "float32",
        grad_scaler=run.scaler is not None,
        clip_grad_norm=run.clip_grad_norm,
        optimizer=type(run.optimizer).__name__ if run.optimizer is not None else "unknown",
        lr=_number(group.get("lr")),
        eps=_number(group.get("eps")),
        param_dtype=_name(params[0].dtype) if params else "float32",
        start_step=result.start_step,
        collapsed=collapsed,
        collapse_why=failure.why if collapsed and failure is not None else "",
    )


def _name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _number(value: object) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    return float(value) if isinstance(value, (int, float)) else None
