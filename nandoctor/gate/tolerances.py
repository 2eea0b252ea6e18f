"""The gate's tolerances, apart from the checks that apply them (`gate.check`): the CLI
states their defaults in `--help`, which must not load the report's health model and
the statistics behind it (docs/performance.md, Start-up)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_HEADROOM = 0.5  # of 65504, checked by default for float16 runs


@dataclass(frozen=True)
class Tolerances:
    max_headroom: float | None = None  # of 65504; None: 0.5, checked for float16 runs only
    max_activation_growth: float | None = None  # opt-in: per module, peak over the baseline's
    max_gradient_growth: float | None = None  # opt-in: per module, and the p90 gradient norm
    skip_streak_margin: int = 2  # scaler skips in a row beyond the baseline's longest
    max_loss_increase: float | None = None  # opt-in, relative: 0.1 lets the loss be 10% worse
    min_magnitude: float = 1e-3  # peaks below this are noise, not growth
    max_headroom_loss: float = 1.5  # a module's peak over the baseline's, above the floor
    headroom_floor: float = 1 / 64  # of the dtype's largest value: where headroom is watched
