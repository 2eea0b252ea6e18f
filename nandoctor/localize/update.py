"""How far the steps before the bad one moved the weights: the update ratio the rules read
(a learning rate too high shows as updates large next to the weights).

A replay re-runs the steps between its snapshot and the bad step; a watched script's
rerun runs them anyway. Either way `UpdateTracker` measures each of them and keeps the
latest step that moved anything (a step the GradScaler skipped moves nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from nandoctor.report.evidence import UpdateRatio
from nandoctor.runtime.state import TrainingObjects
from nandoctor.runtime.tensors import whole

ParamsBefore = Sequence[tuple[nn.Parameter, torch.Tensor]]  # each parameter, and its copy


def update_ratio(model: nn.Module, step: int, before: ParamsBefore) -> UpdateRatio:
    """||w_after - w_before|| / ||w_before||, over all parameters and for the largest one."""
    names = {id(p): n for n, p in model.named_parameters()}
    deltas, norms, ratios = [], [], []
    for p, b in before:
        # NB: a sharded parameter's norms are over all its shards (a collective per norm:
        # every rank replays this step, in lockstep)
        d = whole((_real(p.detach()) - _real(b)).norm())
        n = whole(_real(b).norm())
        deltas.append(d)
        norms.append(n)
        ratios.append(d / n.clamp_min(1e-12))
    ratio = (torch.stack(deltas).norm() / torch.stack(norms).norm().clamp_min(1e-12)).item()
    per = torch.stack(ratios).nan_to_num(posinf=float("inf")).tolist()
    i = max(range(len(per)), key=lambda k: per[k])
    largest = names.get(id(before[i][0]), "?")
    return UpdateRatio(step=step, ratio=ratio, largest=per[i], largest_param=largest)


class UpdateTracker:
    """Call `before()` as a step starts and `after(step)` once it ended; `latest` is the
    update of the last step that moved the weights."""

    def __init__(self, objects: TrainingObjects) -> None:
        self.objects = objects
        self.latest: UpdateRatio | None = None
        self._before: list[tuple[nn.Parameter, torch.Tensor]] | None = None

    def before(self) -> None:
        # NB: the parameters themselves are kept with their copies: a hooked run may learn
        # more of them (its optimizer) during the step
        self._before = [(p, p.detach().clone()) for p in self.objects.params] or None

    def after(self, step: int) -> None:
        before, self._before = self._before, None
        model = self.objects.model
        if before is None or model is None:
            return
        ratio = update_ratio(model, step, before)
        if ratio.ratio > 0:
            self.latest = ratio


def _real(t: torch.Tensor) -> torch.Tensor:
    """A weight as real float32 numbers (a complex one: its real and imaginary parts)."""
    return (torch.view_as_real(t.resolve_conj()) if t.is_complex() else t).float()
