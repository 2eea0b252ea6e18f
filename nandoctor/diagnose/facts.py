"""The run's environment and settings, read once from its training objects, whoever built
them: `diagnose`'s session or the objects the hooks discovered in a user's loop (`Guard`,
`watch`). Both satisfy `TrainingObjects`, so there is one builder of each.
"""

from __future__ import annotations

import torch

from nandoctor.causes.case import LrJump, RunFacts
from nandoctor.diagnose.lr_history import LrHistory, largest_group, number
from nandoctor.report.types import Environment
from nandoctor.runtime.record import RunResult
from nandoctor.runtime.state import TrainingObjects


def environment_of(
    objects: TrainingObjects,
    *,
    autocast_policy: str = "native",
    data_sharding: str | None = None,
) -> Environment:
    """Where the run ran, for the report (a hooked run may not have met its model yet).
    A user's own loop autocasts natively; `diagnose` says which lists its replay used and,
    distributed, how the data was split among the ranks."""
    return Environment(
        device=str(objects.device or "cpu"),
        torch=torch.__version__,
        dtype=_computed_in(objects),
        grad_scaler=objects.scaler is not None,
        threads=torch.get_num_threads(),
        autocast_policy=autocast_policy,
        data_sharding=data_sharding,
    )


def facts_of(
    objects: TrainingObjects,
    result: RunResult,
    checkpoint: str | None = None,
    lrs: LrHistory | None = None,
) -> RunFacts:
    """The settings the rules read, as the run used them.

    The learning rate is the one in effect at the failing step: read from `lrs` (the
    probe that saw each step start) when the run had it, else the param group's now (a
    scheduler changes it there, not in `defaults`; then it may be a step late). Of
    several param groups, the one with the largest rate (its eps too). `checkpoint` is
    the file a `diagnose` run resumed from, which the objects themselves do not know.
    """
    optimizer = objects.optimizer
    # NB: the group with the largest rate: the one a rate too high diverges in
    group = largest_group(optimizer.param_groups) if optimizer is not None else {}
    params = objects.params
    failure = result.failure
    failing = failure.step if failure is not None else None
    lr, lr_start, lr_jump = _rates(group, lrs, failing)
    scheduler = objects.scheduler
    return RunFacts(
        dtype=_computed_in(objects),
        grad_scaler=objects.scaler is not None,
        clip_grad_norm=objects.clip_grad_norm,
        optimizer=type(optimizer).__name__ if optimizer is not None else "unknown",
        lr=lr,
        eps=number(group.get("eps")),
        param_dtype=str(params[0].dtype).removeprefix("torch.") if params else "float32",
        checkpoint=checkpoint,
        start_step=result.start_step,
        lr_start=lr_start,
        lr_jump=lr_jump,
        scheduler=type(scheduler).__name__ if scheduler is not None else None,
        lr_base=number(group.get("initial_lr")) if scheduler is not None else None,
        clipped_scaled=objects.clipped_scaled,
    )


def _rates(
    group: dict, lrs: LrHistory | None, failing: int | None
) -> tuple[float | None, float | None, LrJump | None]:
    """(in effect at the failing step, at the start, the largest jump between): from the
    history when the run kept one, else the param group's rate now and its `initial_lr`
    (which torch's schedulers set)."""
    if lrs is not None and lrs.changes and failing is not None:
        return lrs.at(failing), lrs.start(), lrs.largest_jump(failing)
    return number(group.get("lr")), number(group.get("initial_lr")), None


def _computed_in(objects: TrainingObjects) -> str:
    """The dtype forward and backward compute in, by name: a Session knows it (FSDP's
    param_dtype without autocast); other objects, their autocast's."""
    return _name(getattr(objects, "compute_dtype", objects.dtype)) or "float32"


def _name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None
