"""One sentence a user can act on, from the runs of `compare`.

>>> compare_verdict(runs, "float16", 400)
'bfloat16 survived all 400 steps where float16 went non-finite at step 116 (phase loss);
 float16 was at 100% of its range in blocks.3.mlp.fc2 at step 115: switch autocast to
 bfloat16 (8 exponent bits, the range of float32); its loss stayed within 0.012 of float32'
"""

from __future__ import annotations

from dataclasses import replace

from nandoctor.causes.ranking import FAR_BEHIND
from nandoctor.report.comparison import CompareRun
from nandoctor.report.health import Headroom

HEADROOM_WARNING = 0.5  # a peak above half of 65504 leaves little room
# every dtype failed, the config's this many times sooner than another: two failures
SOONER = 10.0


def compare_verdict(runs: list[CompareRun], config_dtype: str, steps: int) -> str:
    base = next((r for r in runs if r.dtype == config_dtype), runs[0])
    others = [r for r in runs if r is not base]
    survivors = [r for r in others if r.status == "healthy"]
    if any(r.status == "interrupted" for r in runs):
        return "interrupted before every dtype had run; no verdict"
    if base.status == "healthy" and not any(r.status == "nonfinite" for r in others):
        return _all_healthy(base, others, steps)
    if base.status == "healthy":
        failed = ", ".join(_failed_at(r) for r in others if r.status == "nonfinite")
        return f"{base.dtype}, the config's dtype, stayed finite for all {steps} steps; {failed}: keep {base.dtype}"  # noqa: E501
    if survivors:
        return _switch(base, survivors, steps)
    failures = ", ".join(f"{r.dtype} at step {r.first_nonfinite_step}" for r in runs)
    later = [r for r in others if (r.first_nonfinite_step or 0) > (base.first_nonfinite_step or 0)]
    first, last = base.first_nonfinite_step or 0, max(r.first_nonfinite_step or 0 for r in runs)
    if later and last >= SOONER * max(first, 1):
        return (
            f"every dtype went non-finite ({failures}), {base.dtype} {SOONER:g}x sooner: "
            f"two failures, {base.dtype}'s own (its range or precision, which "
            f"{later[0].dtype} outlived) and one every dtype meets later; run `nandoctor "
            f"diagnose` for each (`--dtype {_ALIASES.get(later[0].dtype, later[0].dtype)}` "
            "for the later one)"
        )
    delay = f"; {later[0].dtype} only delays it" if later else ""
    return (
        f"every dtype went non-finite ({failures}){delay}: the dtype is not the cause, so "
        "changing it will not help; run `nandoctor diagnose` for the cause"
    )


_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _unscaled(h: Headroom) -> Headroom:
    return replace(h, gradient_absmax=None, gradient_step=None)


def _all_healthy(base: CompareRun, others: list[CompareRun], steps: int) -> str:
    sentence = f"every dtype stayed finite for all {steps} steps"
    behind = _behind([base, *others])
    tight = _headroom_clause(base)
    if tight and base.dtype == "float16" and not any(r.dtype == "bfloat16" for r in behind):
        sentence += f", but {tight}: little headroom left, consider bfloat16"
    drifts = [
        f"{r.dtype} within {r.max_abs_loss_diff_vs_reference:.3g}"
        for r in [base, *others]
        if r.max_abs_loss_diff_vs_reference  # None without float32; 0 for float32 itself
    ]
    sentence += f"; loss against float32: {', '.join(drifts)}" if drifts else ""
    trails = [_trails(r, [base, *others]) for r in behind]
    return sentence + (f"; but {'; '.join(trails)}" if trails else "")


def _behind(runs: list[CompareRun]) -> list[CompareRun]:
    """The finite runs whose final loss ended `FAR_BEHIND` times above the best one's."""
    best = _best(runs)
    if best is None:
        return []
    return [r for r in runs if _loss(r) and _loss(r) >= FAR_BEHIND * _loss(best)]


def _best(runs: list[CompareRun]) -> CompareRun | None:
    finite = [r for r in runs if r.status == "healthy" and _loss(r)]
    return min(finite, key=_loss) if len(finite) > 1 else None


def _loss(run: CompareRun) -> float:
    """The final loss of a finite run, when it can be weighed against another (> 0)."""
    loss = run.final_loss if run.status == "healthy" else None
    return loss if loss is not None and loss > 0 else 0.0


def _trails(run: CompareRun, runs: list[CompareRun]) -> str:
    best = _best(runs)
    assert best is not None
    ratio = _loss(run) / _loss(best)
    return (
        f"{run.dtype}'s loss ended {ratio:.3g}x above {best.dtype}'s ({run.final_loss:.3g} "
        f"against {best.final_loss:.3g}): it stays finite but does not train as well here"
    )


def _switch(base: CompareRun, survivors: list[CompareRun], steps: int) -> str:
    behind = _behind(survivors)
    survivor = _preferred([r for r in survivors if r not in behind] or survivors)
    sentence = f"{survivor.dtype} survived all {steps} steps where {_failed_at(base)}"
    # NB: only float16's share of 65504 explains a failure; other dtypes' is a forecast.
    # Where the module that went non-finite is known, only its own peak does
    tight = _headroom_clause(base, base.nonfinite_module) if base.dtype == "float16" else None
    if tight:
        sentence += f"; {tight}"
    advice = {
        "bfloat16": "switch autocast to bfloat16 (8 exponent bits: the range of float32)",
        "float32": "only float32 survived: keep the failing part of the model in float32",
    }.get(survivor.dtype, f"switch to {survivor.dtype}")
    if behind and survivor.dtype == "float32":
        advice = "keep the failing part of the model in float32"
    sentence += "".join(f"; {_trails(r, survivors)}" for r in behind)
    sentence += f": {advice}"
    if base.first_nonfinite_phase == "loss":
        sentence += (
            ", or fix the loss: a failure in the loss phase is most often its math (a log "
            "of a softmax that underflowed, a division by a sum), which another dtype only "
            "makes rarer, not impossible; `nandoctor diagnose` names it"
        )
    drift = survivor.max_abs_loss_diff_vs_reference
    if drift is not None and survivor.dtype != "float32" and survivor not in behind:
        sentence += f"; its loss stayed within {drift:.3g} of float32's"
    return sentence


def _preferred(survivors: list[CompareRun]) -> CompareRun:
    order = {"bfloat16": 0, "float16": 1, "float32": 2}
    return min(survivors, key=lambda r: order.get(r.dtype, 3))


def _failed_at(run: CompareRun) -> str:
    phase = f" (phase {run.first_nonfinite_phase})" if run.first_nonfinite_phase else ""
    where = ""
    if run.nonfinite_module is not None:
        where = f", first in the output of {run.nonfinite_module or '(root)'}"
    return f"{run.dtype} went non-finite at step {run.first_nonfinite_step}{phase}{where}"


def _headroom_clause(run: CompareRun, module: str | None = None) -> str | None:
    """How near float16's limit the run came, where it says something: with a GradScaler
    the gradients carry its scale (0.67 x 65536 at step 0 is the scaler calibrating, not
    headroom), so activations alone, as the baseline gate reads them. `module`: that
    module's peak only (another's high peak does not explain where the run broke)."""
    peaks = [_unscaled(h) for h in run.headroom] if run.grad_scaler else run.headroom
    if module is not None:
        peaks = [h for h in peaks if h.module == module]
    peaks = sorted(peaks, key=lambda h: -h.peak_fraction)
    if not peaks or peaks[0].peak_fraction < HEADROOM_WARNING:
        return None
    h = peaks[0]
    grad = (h.gradient_fraction or 0) > h.activation_fraction
    kind, step = ("gradient", h.gradient_step) if grad else ("activation", h.activation_step)
    fraction = min(h.peak_fraction, 1.0)
    return f"{run.dtype}'s {kind} was at {fraction:.0%} of float16's range in {h.module or '(root)'} at step {step}"  # noqa: E501
