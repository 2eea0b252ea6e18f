"""Rewind to the bad step and replay it under the tracer: which op, module, tensor, line.

The replay starts from the newest snapshot at or before the bad step, re-runs the steps
in between plainly, then runs the bad step with the tracer. Afterwards the session is put
back exactly as it was (weights, optimizer, scaler, RNG): localisation leaves no trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from nandoctor.errors import UserCodeError
from nandoctor.localize.tracer import Finding, Tracer
from nandoctor.report.evidence import ModuleStat, UpdateRatio
from nandoctor.report.types import Transient
from nandoctor.runtime import amp
from nandoctor.runtime.probe import Probe
from nandoctor.runtime.snapshot import SnapshotStore
from nandoctor.runtime.step import run_step
from nandoctor.setup.session import Session


@dataclass
class Localization:
    step: int
    finding: Finding | None  # None: the replay saw nothing non-finite (not reproduced)
    modules: list[ModuleStat] = field(default_factory=list)
    from_step: int | None = None
    seconds: float = 0.0
    note: str | None = None
    transients: list[Transient] = field(default_factory=list)  # healed on the way

    @property
    def reproduced(self) -> bool:
        return self.finding is not None


def localize(
    session: Session, store: SnapshotStore, step: int, *, loss_scale: float | None = None
) -> Localization:
    """Replay `step` under the tracer.

    `loss_scale` forces the replayed step's GradScaler scale: after a streak of skips, the
    step is replayed at the scale the streak collapsed to, so that the benign overflow of
    a large scale does not hide the value that stays non-finite at any scale.
    """
    started = time.perf_counter()
    here = store.capture_now(-1)
    try:
        try:
            return _replay(session, store, step, started, loss_scale)
        except MEMORY_ERRORS:
            here.restore(session)
            _free_memory(session)
            located = _replay(session, store, step, started, loss_scale, light=True)
            located.note = "out of memory in the full trace: replayed with a lighter one (no provenance, module magnitudes or float32 rerun)"  # noqa: E501
            return located
    except MEMORY_ERRORS:
        return Localization(step, None, note="out of memory even in the lighter trace")
    except LookupError as e:
        return Localization(step, None, note=f"could not rewind: {e}")
    except UserCodeError as e:
        return Localization(step, None, note=f"the replay of step {step} failed: {e.message}")
    finally:
        here.restore(session)


# NB: torch.OutOfMemoryError is torch >= 2.5's name; torch.cuda's is the older alias
MEMORY_ERRORS = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), MemoryError)


def _free_memory(session: Session) -> None:
    if session.device.type == "cuda":
        torch.cuda.empty_cache()


def _replay(
    session: Session,
    store: SnapshotStore,
    step: int,
    started: float,
    loss_scale: float | None,
    light: bool = False,
) -> Localization:
    batches = store.rewind_for_replay(step)
    update = None
    for s, batch in batches[:-1]:  # re-run the steps in between, measuring their updates
        before = [p.detach().clone() for p in session.params]
        run_step(session, s, batch, Probe())
        ratio = update_ratio(session, s, before)
        update = ratio if ratio.ratio > 0 else update  # a skipped step moves nothing
    note = None
    if loss_scale is not None and session.scaler is not None:
        amp.set_scale(session.scaler, loss_scale, session.device)
        note = f"replayed at loss scale {loss_scale:g}, where the streak of skips ended"
    tracer = Tracer(session.model, session.optimizer, light=light)
    with tracer:
        run_step(session, step, batches[-1][1], tracer)
    finding = tracer.finding
    if finding is not None:
        finding = replace(finding, evidence=replace(finding.evidence, update=update))
    return Localization(
        step=step,
        finding=finding,
        modules=tracer.modules.stats(),
        from_step=batches[0][0],
        seconds=time.perf_counter() - started,
        note=note,
        transients=tracer.transients,
    )


def update_ratio(session: Session, step: int, before: list[torch.Tensor]) -> UpdateRatio:
    """||w_after - w_before|| / ||w_before||, over all parameters and for the largest one."""
    names = [n for n, p in session.model.named_parameters() if p.requires_grad]
    deltas, norms, ratios = [], [], []
    for b, p in zip(before, session.params, strict=True):
        d = (p.detach().float() - b.float()).norm()
        n = b.float().norm()
        deltas.append(d)
        norms.append(n)
        ratios.append(d / n.clamp_min(1e-12))
    ratio = (torch.stack(deltas).norm() / torch.stack(norms).norm().clamp_min(1e-12)).item()
    per = torch.stack(ratios).nan_to_num(posinf=float("inf")).tolist()
    i = max(range(len(per)), key=lambda k: per[k])
    return UpdateRatio(step=step, ratio=ratio, largest=per[i], largest_param=names[i])
