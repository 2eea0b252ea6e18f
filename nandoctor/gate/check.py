"""The baseline gate: compare a run's numeric health with a recorded healthy run's, and
fail CI when the run lost numeric headroom, before that loss is a NaN.

    headroom loss: 6 (Linear) activations peaked at 9784, 15% of float16's 65504 and 300x
    the baseline's 32.6 (limit 1.5x, checked above 1.6% of the range)

What the gate guards is the distance to the dtype's limit, not the training dynamics: a
run with another seed or a larger learning rate that trains as well (or better) moves
its activations, gradient norms and loss, and none of that is a regression of numerics.
So by default it checks what costs a run its headroom:

- headroom: a module's peak (activation or gradient) above a fraction of float16's 65504
  (float16 runs; any run given `--max-headroom`);
- headroom loss: a module's peak at least `headroom_floor` (1/64) of the dtype's largest
  value, and more than `max_headroom_loss` (1.5x) the baseline's: the run gave away more
  than half a bit of range where range is scarce (float16's 65504; bfloat16 and float32
  reach 3.4e38, where no healthy peak comes near the floor). Activations, and gradients
  unless a GradScaler scales them (its own skips guard those);
- scaler skips: a streak of GradScaler skips longer than the baseline's plus a margin.

The dynamics checks of earlier versions (activation growth, gradient growth, the p90
gradient norm, the final loss) stay available, off unless their option is given: they
measured false alarms on healthy runs (docs/ci.md has the numbers).
"""

from __future__ import annotations

import math

from nandoctor.gate.tolerances import DEFAULT_MAX_HEADROOM, Tolerances
from nandoctor.report.gate import Gate, GateCheck
from nandoctor.report.health import Health, ModuleHealth
from nandoctor.report.limits import dtype_max

KINDS = ("activation", "gradient")


def gate_of(
    health: Health,
    dtype: str,
    tol: Tolerances,
    baseline: Health | None = None,
    baseline_path: str | None = None,
    grad_scaler: bool = False,
) -> Gate | None:
    """The run's gate: the headroom limit (float16 runs, or any run given a limit) first,
    then the baseline's checks; None when nothing was asked of it.

    It returns a verdict and never an exit code: the CLI turns `Gate.passed` into one.
    """
    gate = Gate(baseline_path or "")
    if baseline is not None:
        gate = compare_to_baseline(health, baseline, gate.baseline, tol, dtype, grad_scaler)
    limit = tol.max_headroom
    if limit is None and dtype == "float16":
        limit = DEFAULT_MAX_HEADROOM
    if limit is not None:
        gate.checks.insert(0, headroom_check(health, limit))
    return gate if gate.checks else None


def headroom_check(health: Health, limit: float) -> GateCheck:
    where = (
        f" in {health.headroom_module or '(root)'}" if health.headroom_module is not None else ""
    )
    message = (
        f"peak at {percent(health.headroom)} of float16's 65504{where} (limit {percent(limit)})"
    )
    return GateCheck("headroom", health.headroom <= limit, message)


def percent(fraction: float) -> str:
    """Two significant digits below 10%: a bfloat16 run's peak and a tight limit both
    read "0%" in whole percents, and the check's failure made no sense."""
    if fraction == 0 or fraction >= 0.1 or not math.isfinite(fraction):
        return f"{fraction:.0%}"
    return f"{fraction * 100:.2g}%"


def compare_to_baseline(
    current: Health,
    baseline: Health,
    path: str,
    tol: Tolerances,
    dtype: str = "float16",
    grad_scaler: bool = False,
) -> Gate:
    gate = Gate(path)
    kinds = ("activation",) if grad_scaler else KINDS
    gate.checks.append(_headroom_loss(current, baseline, tol, dtype, kinds))
    gate.checks.append(_skips(current, baseline, tol))
    if tol.max_activation_growth is not None:
        gate.checks.append(
            _modules(current, baseline, tol, "activation", tol.max_activation_growth)
        )
    if tol.max_gradient_growth is not None:
        gate.checks.append(_modules(current, baseline, tol, "gradient", tol.max_gradient_growth))
        gate.checks.append(_grad_norm(current, baseline, tol.max_gradient_growth))
    if tol.max_loss_increase is not None:
        gate.checks.append(_loss(current, baseline, tol.max_loss_increase))
    return gate


def _headroom_loss(
    current: Health, baseline: Health, tol: Tolerances, dtype: str, kinds: tuple[str, ...]
) -> GateCheck:
    """With a GradScaler the scaled gradients are the scaler's to keep in range (it halves
    its scale at an overflow, and skip streaks are checked): activations only, then."""
    top = dtype_max(dtype)
    floor = tol.headroom_floor * top
    lost = []
    for now in current.modules:
        then = baseline.counterpart(now)
        for kind in kinds:
            a = _peak(now, kind)
            if a is None or (math.isfinite(a) and a < floor):
                continue
            b = _peak(then, kind) if then is not None else None
            ratio = a / b if b and math.isfinite(a) else math.inf
            if ratio > tol.max_headroom_loss:
                lost.append((now.order, kind, ratio, now, a, b))
    name = "headroom loss"
    if not lost:
        return GateCheck(
            name,
            True,
            f"no module's peak above {tol.headroom_floor:.1%} of {dtype}'s {top:.5g} grew past "
            f"{tol.max_headroom_loss:g}x the baseline's{_uncompared(current, baseline)}",
        )
    # NB: name where it starts: the first activation in forward order, else the last
    # gradient (gradients flow backwards)
    activations = [g for g in lost if g[1] == "activation"]
    _, kind, ratio, m, a, b = (
        min(activations, key=lambda g: g[0]) if activations else max(lost, key=lambda g: g[0])
    )
    was = f"{ratio:.1f}x the baseline's {b:.4g}" if b else "not measured in the baseline"
    others = f" (and {len(lost) - 1} more)" if len(lost) > 1 else ""
    message = (
        f"{m.module or '(root)'} ({m.type}) {kind}s peaked at {a:.4g}, {percent(a / top)} of "
        f"{dtype}'s {top:.5g} and {was} (limit {tol.max_headroom_loss:g}x above "
        f"{tol.headroom_floor:.1%} of the range){others}"
    )
    return GateCheck(name, False, message)


def _uncompared(current: Health, baseline: Health) -> str:
    """What a pass did not compare: a model that gained or lost layers is gated on the
    modules both have, and the reader should know the rest was not."""
    parts = []
    if new := sum(baseline.counterpart(m) is None for m in current.modules):
        parts.append(f"{new} of this run's modules not in the baseline")
    if gone := sum(current.counterpart(m) is None for m in baseline.modules):
        parts.append(f"{gone} of the baseline's not in this run")
    return f" ({', '.join(parts)}: re-record the baseline to gate them)" if parts else ""


def _peak(module: ModuleHealth, kind: str) -> float | None:
    return getattr(module, f"{kind}_absmax")


def _modules(
    current: Health, baseline: Health, tol: Tolerances, kind: str, limit: float
) -> GateCheck:
    grown = []
    for now in current.modules:
        then = baseline.counterpart(now)
        a, b = _peak(now, kind), _peak(then, kind) if then else None
        if a is None or b is None or max(a, b) < tol.min_magnitude:
            continue
        ratio = a / b if b > 0 else float("inf")
        if ratio > limit:
            grown.append((ratio, now, a, b))
    name = f"{kind} growth"
    if not grown:
        return GateCheck(
            name, True, f"every module's {kind} peak within {limit:g}x of the baseline"
        )
    # NB: a module that grows makes the ones after it grow too: name where it starts, the
    # first in forward order for activations, the last for gradients (they flow backwards)
    pick = min if kind == "activation" else max
    ratio, m, a, b = pick(grown, key=lambda g: g[1].order)
    others = f" (and {len(grown) - 1} more)" if len(grown) > 1 else ""
    message = f"{m.module or '(root)'} ({m.type}) {kind}s peaked at {a:.4g}, {ratio:.1f}x the baseline's {b:.4g} (limit {limit:g}x){others}"  # noqa: E501
    return GateCheck(name, False, message)


def _grad_norm(current: Health, baseline: Health, limit: float) -> GateCheck:
    a, b = current.grad_norm.p90, baseline.grad_norm.p90
    if a is None or b is None or b <= 0:
        return GateCheck("gradient norm", True, "no gradient norm to compare")
    ratio = a / b
    message = f"p90 gradient norm {a:.4g}, {ratio:.2f}x the baseline's {b:.4g} (limit {limit:g}x)"
    return GateCheck("gradient norm", ratio <= limit, message)


def _skips(current: Health, baseline: Health, tol: Tolerances) -> GateCheck:
    allowed = baseline.longest_skip_streak + tol.skip_streak_margin
    message = f"longest streak of GradScaler skips {current.longest_skip_streak} (baseline {baseline.longest_skip_streak}, limit {allowed})"  # noqa: E501
    return GateCheck("scaler skips", current.longest_skip_streak <= allowed, message)


def _loss(current: Health, baseline: Health, increase: float) -> GateCheck:
    a, b = current.final_loss, baseline.final_loss
    if a is None or b is None:
        return GateCheck("final loss", a is not None or b is None, "no finite loss to compare")
    limit = b + abs(b) * increase
    message = f"final loss {a:.4g} (baseline {b:.4g}, limit {limit:.4g})"
    return GateCheck("final loss", a <= limit, message)
