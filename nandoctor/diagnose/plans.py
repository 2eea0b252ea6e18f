"""The replay each fix asks for (`plan`): its config change applied (`CHANGES`: how each
`Change` is applied, or why it cannot be to this run), its cause's math patch attached, or
the origin op guarded (`OriginGuardPatch`, made from the op and source line the replay
named). A fix that applies to this run but that no replay can show is `Unplayable`, with
the reason the report prints. How far back each fix's effect reaches (`REACH`) decides
where its replay starts. diagnose/verify.py runs the plans.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum

import torch

from nandoctor.causes.case import Case
from nandoctor.causes.unit import Change, Fix
from nandoctor.causes.words import OVERFLOWED
from nandoctor.registry import Registry
from nandoctor.runtime import safe_ops
from nandoctor.runtime.patches import PATCHES, MathPatch, OpSite, OriginGuardPatch
from nandoctor.runtime.safe_ops import family
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import Session


class Reach(Enum):
    """How far back a fix's effect reaches: where its replay must start to show it."""

    LOADED = "the weights as loaded"  # acts where the run starts: replayed from there only
    HISTORY = "every step's update"  # the weights' whole trajectory: the snapshot may be late
    LOCAL = "the failing step's math"  # acts where the run failed: the snapshot settles it


# NB: by what each change does to the run, not by the cause that asks for it. A rate, a
# clip or a dtype changes every update before the snapshot too: refuted from there, such a
# fix may still hold from step 0. An eps raised or a bad batch skipped acts on the step
# that failed, as a math patch or the origin op's guard does (`plan`: LOCAL)
REACH: dict[Change, Reach] = {
    Change.BFLOAT16: Reach.HISTORY,
    Change.CLIP_GRAD_NORM: Reach.HISTORY,
    Change.SMALLER_LR: Reach.HISTORY,
    Change.OPTIMIZER_EPS: Reach.LOCAL,
    Change.SKIP_NONFINITE_BATCHES: Reach.LOCAL,
    Change.ZERO_NONFINITE_WEIGHTS: Reach.LOADED,
}


@dataclass(frozen=True)
class Plan:
    """One fix to replay: a changed config, a patch or input filter, a change to the
    session once built (`prepare`: the loaded weights' non-finite entries zeroed)."""

    describe: str
    loaded: LoadedConfig
    patch: Callable[[], MathPatch] | None = None
    skip_nonfinite_batches: bool = False
    prepare: Callable[[Session], None] | None = None
    reach: Reach = Reach.LOCAL

    @property
    def from_start(self) -> bool:
        """Never resumed from a snapshot: its effect is where the run starts."""
        return self.reach is Reach.LOADED


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
    """The config's lr / 10: with a scheduler that multiplies it, the rate in effect at
    every step is 10x smaller too; the sentence quotes the rate in effect when known."""
    optimizer = loaded.config.optimizer
    lr = optimizer.kwargs.get("lr")
    if not isinstance(lr, (int, float)):
        return None
    smaller = optimizer.model_copy(update={"lr": lr / 10})
    effect, step = case.facts.lr, case.first.step
    if effect is not None and not _close(effect, lr):
        what = f"{effect / 10:g} in effect at step {step}, instead of {effect:g}"
    else:
        what = f"{lr / 10:g}"
    return Plan(
        f"with a 10x smaller learning rate ({what})", loaded.with_overrides(optimizer=smaller)
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
        f"with the optimizer's eps raised to {eps:g}",
        loaded.with_overrides(optimizer=raised),
        prepare=functools.partial(_set_eps, eps=eps),
    )


def _set_eps(session: Session, eps: float) -> None:
    """The raised eps in every param group, once the session is built: a checkpoint's
    optimizer state (`optimizer.load_state_dict`) brings back the eps it was saved with,
    and the one in the config then changes nothing."""
    for group in session.optimizer.param_groups:
        if isinstance(group.get("eps"), (int, float)):  # NB: not Adafactor's pair
            group["eps"] = eps


@applies(Change.ZERO_NONFINITE_WEIGHTS)
def _zero_weights(case: Case, loaded: LoadedConfig) -> Plan | None:
    if loaded.config.checkpoint is None:
        return None  # NB: weights that went bad during the run are not "loaded" ones
    return Plan(
        "with the non-finite entries of the loaded weights and optimizer state zeroed",
        loaded,
        prepare=zero_nonfinite,
    )


def zero_nonfinite(session: Session) -> None:
    """Zero every NaN and inf in the session's weights, buffers and optimizer state."""
    with torch.no_grad():
        for t in [*session.model.parameters(), *session.model.buffers()]:
            if t.is_floating_point():
                t.nan_to_num_(0.0, 0.0, 0.0)
        for state in session.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    value.nan_to_num_(0.0, 0.0, 0.0)


def origin_site(case: Case) -> OpSite | None:
    """Where the origin op ran, as the guard needs it: its family (the forward function's,
    for a failure in a backward), and its line: that of the library file it ran in when
    the report shows one past torch's own (a transformers modeling file), else the
    user's; None when the replay named no op or no user line."""
    first = case.first
    if first.op is None or not first.source or not _line_of(first.source):
        return None
    backward_of = case.evidence.backward_of
    name = backward_of.split(" ")[0] if first.phase == "backward" and backward_of else first.op
    fam, overflowed = family(name)[0], first.value in OVERFLOWED
    scale = _of_a_scale(case, fam)
    library = next((f for f in first.frames if not f.user and not _torchs(f.file)), None)
    if library is not None:
        return OpSite(fam, library.file, library.line, overflowed, library=True, scale=scale)
    path, line = first.source.rpartition(":")[0], _line_of(first.source)
    return OpSite(fam, os.path.realpath(path), line, overflowed, scale=scale)


def _of_a_scale(case: Case, fam: str) -> bool:
    """The origin is an exp, in the forward, of one value: a learnable scale (CLIP's
    `logit_scale.exp()`), whose guard is a cap."""
    inputs = case.evidence.inputs
    forward = case.first.phase in ("forward", "loss")
    return fam == "exp" and forward and len(inputs) == 1 and inputs[0].numel == 1


def _torchs(shown: str) -> bool:
    """A frame of torch's own (`F.softmax`'s body): every softmax passes through it."""
    return shown.split("/", 1)[0] == "torch"


def _line_of(source: str) -> int:
    line = source.rpartition(":")[2]
    return int(line) if line.isdigit() else 0


@dataclass(frozen=True)
class Unplayable:
    """A fix that applies to this run but that no replay can show, and why (a clause)."""

    why: str


def _futile(site: OpSite, case: Case) -> bool:
    """A guard that would only run in float32 an op that overflowed float32's range
    already (or bfloat16's, the same): it would fail as the run did."""
    float32 = safe_ops.family(site.family)[1] is safe_ops.SafeForm.FLOAT32
    wide = case.first.dtype in ("float32", "bfloat16", "float64")
    return float32 and site.overflowed and wide and not site.scale


def plan(cause_id: str, fix: Fix, case: Case, loaded: LoadedConfig) -> Plan | Unplayable | None:
    """The replay `fix` asks for: its config change applied, its cause's patch attached,
    or the origin op guarded; None when it cannot be applied to this run."""
    if fix.guard:
        site = origin_site(case)
        if site is None:
            return None
        if _futile(site, case):
            return Unplayable(
                f"the {site.family} overflowed {case.first.dtype}, so running it in float32 "
                "changes nothing, and its argument has no bound nandoctor could choose for "
                "you (only a learnable scale, one value, has one): rewrite it in log space"
            )
        guard = OriginGuardPatch(site)
        return Plan(f"with {guard.describe}", loaded, patch=lambda: OriginGuardPatch(site))
    changed = Plan("", loaded) if fix.change is None else CHANGES[fix.change.name](case, loaded)
    if changed is not None and fix.change is not None:
        changed = replace(changed, reach=REACH[fix.change])
    if changed is None or not fix.patch:
        return changed
    patch = PATCHES[cause_id]
    words = f"{changed.describe} and" if changed.describe else "with"
    return replace(changed, describe=f"{words} {patch.describe}", patch=patch)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
