"""How far the steps before the bad one moved the weights: the update ratio the rules read
(a learning rate too high shows as updates large next to the weights).

A replay re-runs the steps between its snapshot and the bad step; a watched script's
rerun runs them anyway. Either way `UpdateTracker` measures each of them and keeps the
latest step that moved anything (a step the GradScaler skipped moves nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from nandoctor.report.evidence import UpdateRatio
from nandoctor.runtime.state import TrainingObjects
from nandoctor.runtime.tensors import whole

ParamsBefore = Sequence[tuple[nn.Parameter, torch.Tensor]]  # each parameter, and its copy


def update_ratio(model: nn.Module, step: int, before: ParamsBefore) -> UpdateRatio:
    """||w_after - w_before|| / ||w_before||, over all parameters and for the largest one.

    NB: in float64: a diverging run's float32 weights grow past ~1e19, where float32
    squares overflow, and an infinite ratio would claim the update broke weights that are
    still finite. An update that did leave weights non-finite has an infinite ratio; with
    weights already non-finite before it the ratio is NaN (no update measured)."""
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
    norm = torch.stack(norms).norm()
    ratio = (torch.stack(deltas).norm() / norm.clamp_min(1e-12)).item()
    per = torch.stack(ratios).nan_to_num(nan=math.inf).tolist()  # NB: NaN after: broken
    broken = [k for k, r in enumerate(per) if r == math.inf]
    sizes = torch.stack(norms).tolist()  # NB: one host read, not one per parameter
    i = max(broken or _telling(before, sizes), key=lambda k: per[k])
    largest = names.get(id(before[i][0]), "?")
    if not norm.isfinite():
        ratio = math.nan  # the weights were non-finite before the step: nothing measured
    elif not math.isfinite(ratio) or per[i] == math.inf:
        ratio = math.inf
    return UpdateRatio(step=step, ratio=ratio, largest=per[i], largest_param=largest)


def _telling(before: ParamsBefore, sizes: list[float]) -> list[int]:
    """The parameters whose ratio says something: the weight matrices (a zero-initialised
    bias or norm shift moved by 1e-3 is a ratio of 1e9, and no sign of a rate too high),
    then any with a norm; all of them where none qualifies. `sizes`: their norms before."""
    sized = [k for k, n in enumerate(sizes) if n > 0 or not math.isfinite(n)]
    matrices = [k for k in sized if before[k][1].dim() >= 2]
    return matrices or sized or list(range(len(before)))


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
        if ratio.ratio > 0:  # NB: not NaN: the weights were non-finite before the step
            self.latest = ratio


def _real(t: torch.Tensor) -> torch.Tensor:
    """A weight as real float64 numbers (a complex one: its real and imaginary parts)."""
    return (torch.view_as_real(t.resolve_conj()) if t.is_complex() else t).double()
