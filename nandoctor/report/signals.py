"""The forecast's precursor signals, as plain data: where each was measured (`Site`), how the
values one step carried are laid out (`Layout`), and the run's summary curves (`Curves`).

A probe on the device (`runtime.precursors`) measures, every step, each module's largest
|output|, each softmax's widest row and largest input, and each parameter group's update;
the host adds what the sentinel reads anyway (the loss, the gradient norm, the loss
scale). A step's values, read with the sentinel's one read, come back as a flat list::

    Layout(peaks=(Site("activation_peak", "fc2", ...),), others=(Site("softmax_spread", ...),),
           updates=(0, 0))
    values = [412.0, -398.5,  11.2,  0.021, 0.019,  3.1, 2.9]
    #         fc2's max, min  spread  |dw| of two tensors  |w| of the same two

`Layout.read` turns them into (site, value) pairs: the peak is max(max, -min), and each
group's update ratio is sqrt(sum |dw|^2) / sqrt(sum |w|^2) over its sampled tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

ACTIVATION_PEAK = "activation_peak"  # a module's largest |output| (limit: its dtype's largest)
SOFTMAX_SPREAD = "softmax_spread"  # a softmax row's max - min (limit: where a probability is 0)
ATTENTION_LOGIT = "attention_logit"  # the largest input of a softmax or an attention
UPDATE_RATIO = "update_ratio"  # |dw| / |w| of a parameter group, each step
GRAD_NORM = "grad_norm"  # the gradients' norm (unscaled)
LOSS = "loss"  # the loss itself, climbing while its z-score stays high
LOSS_SCALE = "loss_scale"  # the GradScaler's scale
SKIP_RATE = "skip_rate"  # the GradScaler's skips per step, over the recent steps
LOSS_Z = "loss_z"  # the loss's z-score against its own recent history (ZClip's EMA form)


class Site(NamedTuple):
    """Where a device signal was measured: `module` is a dotted path (None: outside the
    model, the loss); `op` the operator that received the values (a softmax's), None for
    a module's output; `dtype` the one the values are held (or the op runs) in; `limit`
    the value past which the run fails. `logged`: a softmax whose output a log received
    (`log(softmax(x))`), the one kind whose underflow is a failure. NB: a tuple, not a
    dataclass: it keys a dict each step for every signal, and a tuple hashes in C."""

    metric: str
    module: str | None
    op: str | None
    dtype: str
    limit: float
    logged: bool = False


@dataclass(frozen=True)
class Layout:
    """The order of one step's values: each peak's max then, after all of them, each
    peak's min; one value per other site; then the sampled tensors' update norms and
    weight norms, `updates` naming each one's parameter group."""

    peaks: tuple[Site, ...] = ()
    others: tuple[Site, ...] = ()
    updates: tuple[int, ...] = ()
    dtype: str = "float32"  # the parameters' (the update ratio's site)

    @property
    def size(self) -> int:
        return 2 * len(self.peaks) + len(self.others) + 2 * len(self.updates)

    def read(self, values: Sequence[float]) -> list[tuple[Site, float]]:
        """The (site, value) pairs of one step (a site measured twice: its larger value)."""
        n, m = len(self.peaks), len(self.others)
        out: dict[Site, float] = {}
        for i, site in enumerate(self.peaks):
            _keep_max(out, site, max(values[i], -values[n + i]))
        for site, value in zip(self.others, values[2 * n : 2 * n + m], strict=True):
            _keep_max(out, site, value)
        for group, ratio in self._ratios(values[2 * n + m :]).items():
            site = Site(UPDATE_RATIO, f"param_groups.{group}", None, self.dtype, 1.0)
            out[site] = ratio
        return list(out.items())

    def _ratios(self, values: Sequence[float]) -> dict[int, float]:
        k = len(self.updates)
        moved: dict[int, float] = {}
        size: dict[int, float] = {}
        for group, dw, w in zip(self.updates, values[:k], values[k : 2 * k], strict=True):
            moved[group] = moved.get(group, 0.0) + dw * dw
            size[group] = size.get(group, 0.0) + w * w
        return {g: math.sqrt(moved[g] / size[g]) for g in moved if size[g] > 0}


def _keep_max(out: dict[Site, float], site: Site, value: float) -> None:
    kept = out.get(site)
    if kept is None or not value <= kept:  # NB: a NaN is kept (it is the failure's)
        out[site] = value


@dataclass
class Curves:
    """The signals as curves, one point a step, for TensorBoard: per metric the largest
    value of any site as a fraction of its limit (`activation_peak`, `softmax_spread`,
    `attention_logit`), each group's update ratio (`update_ratio/<group>`), the gradient
    norm's growth a step, the GradScaler's skip rate and the loss's z-score."""

    points: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    def add(self, name: str, step: int, value: float) -> None:
        steps, values = self.points.setdefault(name, ([], []))
        steps.append(step)
        values.append(value)


__all__ = [
    "ACTIVATION_PEAK",
    "ATTENTION_LOGIT",
    "GRAD_NORM",
    "LOSS",
    "LOSS_SCALE",
    "LOSS_Z",
    "SKIP_RATE",
    "SOFTMAX_SPREAD",
    "UPDATE_RATIO",
    "Curves",
    "Layout",
    "Site",
]
