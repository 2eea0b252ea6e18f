"""The baseline gate: compare a run's numeric health with a recorded healthy run's, and
fail CI on a regression that has not produced a NaN yet.

    baseline activation growth: fc2 (Linear) activations peaked at 41.2, 2.0x the
    baseline's 20.6 (limit 1.5x)

Every tolerance has a documented default and a command-line override.
"""

from __future__ import annotations

from dataclasses import dataclass

from nandoctor.report.gate import Check, Gate
from nandoctor.report.health import Health

DEFAULT_MAX_HEADROOM = 0.5  # of 65504, checked by default for float16 runs


@dataclass(frozen=True)
class Tolerances:
    max_headroom: float | None = None  # of 65504; None: 0.5, checked for float16 runs only
    max_activation_growth: float = 1.5  # per module, peak over the baseline's peak
    max_gradient_growth: float = 2.0  # per module, and for the gradient norm's p90
    skip_streak_margin: int = 2  # scaler skips in a row beyond the baseline's longest
    max_loss_increase: float = 0.1  # relative: the final loss may be 10% worse
    min_magnitude: float = 1e-3  # peaks below this are noise, not growth


def gate_of(
    health: Health,
    dtype: str,
    tol: Tolerances,
    baseline: Health | None = None,
    baseline_path: str | None = None,
) -> Gate | None:
    """The run's gate: the headroom limit (float16 runs, or any run given a limit) first,
    then the baseline's checks; None when nothing was asked of it.

    It returns a verdict and never an exit code: the CLI turns `Gate.passed` into one.
    """
    gate = Gate(baseline_path or "")
    if baseline is not None:
        gate = compare_to_baseline(health, baseline, gate.baseline, tol)
    limit = tol.max_headroom
    if limit is None and dtype == "float16":
        limit = DEFAULT_MAX_HEADROOM
    if limit is not None:
        gate.checks.insert(0, headroom_check(health, limit))
    return gate if gate.checks else None


def headroom_check(health: Health, limit: float) -> Check:
    where = (
        f" in {health.headroom_module or '(root)'}" if health.headroom_module is not None else ""
    )
    message = f"peak at {health.headroom:.0%} of float16's 65504{where} (limit {limit:.0%})"
    return Check("headroom", health.headroom <= limit, message)


def compare_to_baseline(current: Health, baseline: Health, path: str, tol: Tolerances) -> Gate:
    gate = Gate(path)
    gate.checks.append(_modules(current, baseline, tol, "activation", tol.max_activation_growth))
    gate.checks.append(_modules(current, baseline, tol, "gradient", tol.max_gradient_growth))
    gate.checks.append(_grad_norm(current, baseline, tol))
    gate.checks.append(_skips(current, baseline, tol))
    gate.checks.append(_loss(current, baseline, tol))
    return gate


def _modules(current: Health, baseline: Health, tol: Tolerances, kind: str, limit: float) -> Check:
    grown = []
    for now in current.modules:
        then = baseline.module(now.module)
        a, b = getattr(now, f"{kind}_absmax"), getattr(then, f"{kind}_absmax") if then else None
        if a is None or b is None or max(a, b) < tol.min_magnitude:
            continue
        ratio = a / b if b > 0 else float("inf")
        if ratio > limit:
            grown.append((ratio, now, a, b))
    name = f"{kind} growth"
    if not grown:
        return Check(name, True, f"every module's {kind} peak within {limit:g}x of the baseline")
    # NB: a module that grows makes the ones after it grow too: name where it starts, the
    # first in forward order for activations, the last for gradients (they flow backwards)
    pick = min if kind == "activation" else max
    ratio, m, a, b = pick(grown, key=lambda g: g[1].order)
    others = f" (and {len(grown) - 1} more)" if len(grown) > 1 else ""
    message = f"{m.module or '(root)'} ({m.type}) {kind}s peaked at {a:.4g}, {ratio:.1f}x the baseline's {b:.4g} (limit {limit:g}x){others}"  # noqa: E501
    return Check(name, False, message)


def _grad_norm(current: Health, baseline: Health, tol: Tolerances) -> Check:
    a, b = current.grad_norm.p90, baseline.grad_norm.p90
    if a is None or b is None or b <= 0:
        return Check("gradient norm", True, "no gradient norm to compare")
    ratio = a / b
    message = f"p90 gradient norm {a:.4g}, {ratio:.2f}x the baseline's {b:.4g} (limit {tol.max_gradient_growth:g}x)"  # noqa: E501
    return Check("gradient norm", ratio <= tol.max_gradient_growth, message)


def _skips(current: Health, baseline: Health, tol: Tolerances) -> Check:
    allowed = baseline.longest_skip_streak + tol.skip_streak_margin
    message = f"longest streak of GradScaler skips {current.longest_skip_streak} (baseline {baseline.longest_skip_streak}, limit {allowed})"  # noqa: E501
    return Check("scaler skips", current.longest_skip_streak <= allowed, message)


def _loss(current: Health, baseline: Health, tol: Tolerances) -> Check:
    a, b = current.final_loss, baseline.final_loss
    if a is None or b is None:
        return Check("final loss", a is not None or b is None, "no finite loss to compare")
    limit = b + abs(b) * tol.max_loss_increase
    message = f"final loss {a:.4g} (baseline {b:.4g}, limit {limit:.4g})"
    return Check("final loss", a <= limit, message)
