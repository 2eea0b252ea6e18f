"""What-if verification: apply a fix nandoctor can make itself, replay, see if it holds.

Which fixes apply to a cause is data in the cause's module (`FIXES` there, gathered in
`causes.index.FIXES`): a config change (`Change`: bfloat16, clipping, a 10x smaller
learning rate, a usable optimizer epsilon, skipping non-finite batches) and/or its math
patch (registered under its id in `runtime/patches.py`). This module is the engine: how
each change is applied to the config (`CHANGES`), and the replay. The replay rebuilds the
run from its start (the same seed, or the checkpoint), so it sees the same initial weights
and the same batches, applies the fix for the whole run, as a user would, and runs **past
the failing step by a horizon** (a quarter of the steps to the failure, at least 32).
Surviving the horizon verifies the fix; failing anywhere refutes it, with the step and
phase; running out of the time budget leaves it unverified.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from nandoctor.causes.case import Case
from nandoctor.causes.index import FIXES
from nandoctor.causes.unit import Change, Fix, fix_for
from nandoctor.errors import NandoctorError
from nandoctor.registry import Registry
from nandoctor.report.types import Cause
from nandoctor.runtime.fast_run import fast_run
from nandoctor.runtime.patches import PATCHES, MathPatch
from nandoctor.runtime.probe import Probe
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import build_session

MIN_HORIZON = 32


@dataclass(frozen=True)
class Plan:
    """One fix to replay: a changed config and/or a patch or input filter."""

    describe: str
    loaded: LoadedConfig
    patch: Callable[[], MathPatch] | None = None
    skip_nonfinite_batches: bool = False


Applier = Callable[[Case, LoadedConfig], Plan | None]
CHANGES: Registry[Applier] = Registry("config change")


def applies(change: Change) -> Callable[[Applier], Applier]:
    """Register how `change` is applied: the plan, or None where it cannot be."""

    def register(fn: Applier) -> Applier:
        CHANGES.add(change.name, fn, by=f"{fn.__module__}.{fn.__qualname__}")
        return fn

    return register


@applies(Change.BFLOAT16)
def _bfloat16(case: Case, loaded: LoadedConfig) -> Plan | None:
    if case.facts.dtype != "float16":
        return None
    return Plan(
        "with bfloat16 autocast instead of float16", loaded.with_overrides(dtype="bfloat16")
    )


@applies(Change.CLIP_GRAD_NORM)
def _clip(case: Case, loaded: LoadedConfig) -> Plan | None:
    clip = loaded.config.clip_grad_norm
    if clip is not None and clip <= 1.0:
        return None
    return Plan(
        "with unscale_ then clip_grad_norm_(1.0)", loaded.with_overrides(clip_grad_norm=1.0)
    )


@applies(Change.SMALLER_LR)
def _smaller_lr(case: Case, loaded: LoadedConfig) -> Plan | None:
    optimizer = loaded.config.optimizer
    lr = optimizer.kwargs.get("lr")
    if not isinstance(lr, (int, float)):
        return None
    smaller = optimizer.model_copy(update={"lr": lr / 10})
    return Plan(
        f"with a 10x smaller learning rate ({lr / 10:g})", loaded.with_overrides(optimizer=smaller)
    )


@applies(Change.SKIP_NONFINITE_BATCHES)
def _filter_inputs(case: Case, loaded: LoadedConfig) -> Plan | None:
    return Plan("with batches holding NaN or inf skipped", loaded, skip_nonfinite_batches=True)


@applies(Change.OPTIMIZER_EPS)
def _optimizer_eps(case: Case, loaded: LoadedConfig) -> Plan | None:
    optimizer = loaded.config.optimizer
    if optimizer.name is None:
        return None
    eps = max(1e-8, float(torch.finfo(getattr(torch, case.facts.param_dtype)).tiny))
    raised = optimizer.model_copy(update={"eps": eps})
    return Plan(
        f"with the optimizer's eps raised to {eps:g}", loaded.with_overrides(optimizer=raised)
    )


def plan(cause_id: str, fix: Fix, case: Case, loaded: LoadedConfig) -> Plan | None:
    """The replay `fix` asks for: its config change applied, its cause's patch attached."""
    changed = Plan("", loaded) if fix.change is None else CHANGES[fix.change.name](case, loaded)
    if changed is None or not fix.patch:
        return changed
    patch = PATCHES[cause_id]
    words = f"{changed.describe} and" if changed.describe else "with"
    return replace(changed, describe=f"{words} {patch.describe}", patch=patch)


def verify(cause: Cause, case: Case, loaded: LoadedConfig, deadline: float) -> Cause:
    """The cause with `verified` and a `verification` sentence, when a fix applies."""
    fixes = FIXES.get(cause.id)
    fix = fix_for(fixes, case.first.phase) if fixes else None
    replayed = plan(cause.id, fix, case, loaded) if fix is not None else None
    if replayed is None:
        return cause
    verified, sentence = _replay(replayed, case, deadline)
    return replace(cause, verified=verified, verification=sentence)


def horizon(case: Case) -> int:
    return max(MIN_HORIZON, (case.first.step - case.facts.start_step) // 4)


def _replay(plan: Plan, case: Case, deadline: float) -> tuple[bool | None, str]:
    failing = case.first.step
    target = failing + horizon(case)
    steps = target - case.facts.start_step + 1
    if time.perf_counter() > deadline:
        return None, f"not verified {plan.describe}: the time budget ran out"
    patch = plan.patch() if plan.patch else None
    try:
        session = build_session(plan.loaded)
        result = fast_run(
            session, steps, probe=patch or Probe(), deadline=deadline,
            skip_nonfinite_batches=plan.skip_nonfinite_batches,
        )  # fmt: skip
    except NandoctorError as e:
        return None, f"not verified {plan.describe}: the replay failed: {e.message}"
    return _judge(plan, patch, result, failing, target, steps)


def _judge(plan, patch, result, failing: int, target: int, steps: int) -> tuple[bool | None, str]:
    if result.status == "interrupted":
        raise KeyboardInterrupt
    if patch is not None and patch.hits == 0 and result.status != "healthy":
        return None, f"not verified {plan.describe}: the patch found nothing to rewrite"
    if result.status == "timeout":
        reached = result.start_step + result.steps_run
        return (
            None,
            f"not verified {plan.describe}: the time budget ran out at step {reached} of {target}",
        )
    if result.failure is not None:
        f = result.failure
        phase = f.phase.value if f.phase else "?"
        return (
            False,
            f"{plan.describe}, the run still went non-finite at step {f.step} (phase {phase})",
        )
    return (
        True,
        (
            f"{plan.describe}, {result.steps_run}/{steps} steps stayed finite, to step {target}, "
            f"past the failing step {failing}"
        ),
    )
