"""The rules of SPEC.md that turn a step's reading into a verdict (`Judge`), whoever drives
the step: `runtime.sentinel` reads the step, the judge decides, `runtime.verdict` holds
what it decided.

A step fails when its loss, gradients or weights went non-finite (or its weights were
before it), and its phase is the first whose values went non-finite, the batch's
included; a NaN in the batch that the loss selects away heals (labels missing as NaN),
as any transient does. A GradScaler skip is an event when it was an overflow: the judge
asks the driver to recheck the step's gradients at loss scale 1 (`runtime.recheck`; only
on a skip, so a clean step costs nothing), and a step whose gradients are non-finite
there too is the failure the scaler hid. A driver that cannot re-run its loop (the hooks)
answers "unchecked", and the streak rule is then the only guard: skips in a row until the
scale collapses are a failure, either way (`StepOutcome` draws the transitions).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from nandoctor.runtime.probe import Phase
from nandoctor.runtime.verdict import Reading, StepOutcome, Verdict

# A collapse: MAX_SKIP_STREAK skips in a row at a scale of at most STREAK_CEILING (a
# healthy fp16 run skips a handful at its start; docs/diagnosis.md says why 10), or a
# scale below MIN_SCALE. Skips above the ceiling are a larger init_scale coming down.
MAX_SKIP_STREAK = 10
STREAK_CEILING = 2.0**16  # torch's default init_scale
MIN_SCALE = 1.0  # a loss scale below this (and below init_scale / 2**16) has collapsed

# Recheck a skipped step at loss scale 1: True when its gradients are non-finite there
# too, False when finite, None when it cannot (`runtime.recheck.ScaleOneRecheck`).
Recheck = Callable[[int], "bool | None"]


class Judge:
    """Turns readings into verdicts, remembering the current streak of scaler skips.

    `recheck` (see `Recheck`) is asked about each skip: a step still non-finite at loss
    scale 1 fails there; an overflow, or a skip it could not check, joins the streak.
    """

    def __init__(
        self,
        max_streak: int = MAX_SKIP_STREAK,
        min_scale: float = MIN_SCALE,
        backoff: float = 0.5,
        recheck: Recheck | None = None,
    ) -> None:
        self.max_streak = max_streak
        self.min_scale = min_scale
        self.backoff = backoff
        self.recheck = recheck
        self.streak_start: int | None = None
        self.streak = 0  # skips in a row
        self.counted = 0  # of them, those at a scale of at most STREAK_CEILING

    @classmethod
    def for_scaler(
        cls, scaler: torch.amp.GradScaler | None, recheck: Recheck | None = None
    ) -> Judge:
        if scaler is None:
            return cls(recheck=recheck)
        # NB: a user who starts at a tiny init_scale on purpose has not collapsed at 1.0.
        min_scale = min(MIN_SCALE, scaler.get_scale() / 2**16)
        return cls(min_scale=min_scale, backoff=scaler.get_backoff_factor(), recheck=recheck)

    def __call__(self, r: Reading) -> Verdict:
        """NB: a non-finite batch or model output fails a step only with what it reaches:
        the loss, the gradients or the weights. Values the loss selects away (labels
        missing as NaN, masked positions) heal; the step is healthy. When the step does
        fail, its phase is the first that went non-finite, the batch's included."""
        if r.params_before or r.loss_bad:  # NB: the rare case
            return self._failed_before_backward(r)
        if r.aborted and (r.input or r.forward):  # NB: what it saw is all there is
            failed = self._failed_before_backward(r)
            return dataclasses.replace(failed, why=f"{failed.why}; the step raised before it ended")
        if r.grads:
            return self._upstream(r, self._bad_gradients(r))
        self.streak, self.counted, self.streak_start = 0, 0, None
        if r.params:
            why = "the optimizer's update made parameters non-finite"
            failed = Verdict(r, StepOutcome.FAILED, step=r.step, phase=Phase.OPTIMIZER, why=why)
            return self._upstream(r, failed)
        return Verdict(r)

    def _upstream(self, r: Reading, verdict: Verdict) -> Verdict:
        """A failure of this step's gradients or update whose batch or model output was
        already non-finite began there (not a collapse: it points back to its streak)."""
        if not (r.input or r.forward) or not verdict.failed or verdict.collapsed:
            return verdict
        # NB: FAILED, or HIDDEN (its gradients non-finite at loss scale 1 too): it stays so
        return dataclasses.replace(self._failed_before_backward(r), outcome=verdict.outcome)

    def _failed_before_backward(self, r: Reading) -> Verdict:
        """The first phase before the backward whose values went non-finite."""
        phase, why = next(
            (phase, why)
            for phase, flagged, why in (
                (Phase.PARAMETERS, r.params_before, "parameters were non-finite before the step"),
                (Phase.INPUT, r.input, "the batch held non-finite values"),
                (Phase.FORWARD, r.forward, "the model's output was non-finite"),
                (Phase.LOSS, r.loss_bad, "the loss was non-finite"),
            )
            if flagged
        )
        return Verdict(r, StepOutcome.FAILED, step=r.step, phase=phase, why=why)

    def _bad_gradients(self, r: Reading) -> Verdict:
        if r.scale is None:
            why = "gradients were non-finite (no GradScaler to skip the step)"
            return Verdict(r, StepOutcome.FAILED, step=r.step, phase=Phase.BACKWARD, why=why)
        still_bad = self.recheck(r.step) if self.recheck is not None else None
        if still_bad:
            return hidden_failure(r)
        if self.streak == 0:
            self.streak_start = r.step
        self.streak += 1
        self.counted += r.scale <= STREAK_CEILING
        next_scale = r.scale * self.backoff
        if self.counted >= self.max_streak or next_scale < self.min_scale:
            # NB: the scale the last skipped step used, as the evidence and the telemetry
            # quote it (not the one `update()` then halved it to)
            at = f"loss scale {_fmt(r.scale)}"
            why = (
                f"the GradScaler skipped {self.streak} steps in a row from step "
                f"{self.streak_start}, the last at {at}"
                if self.streak > 1
                else f"the GradScaler skipped step {self.streak_start} at {at}"
            )
            step, phase, unchecked = self.streak_start, Phase.BACKWARD, still_bad is None
            return Verdict(
                r, StepOutcome.COLLAPSED, step=step, phase=phase, unchecked=unchecked, why=why
            )
        skip = StepOutcome.SKIPPED_UNCHECKED if still_bad is None else StepOutcome.SKIPPED_OVERFLOW
        return Verdict(r, skip, streak_start=self.streak_start)


def hidden_failure(r: Reading, rechecked: str = "") -> Verdict:
    """The failure a GradScaler skip hid: its gradients non-finite at loss scale 1 too
    (`rechecked`: how, when not as the step ran)."""
    why = (
        f"the GradScaler skipped step {r.step}, but its gradients are non-finite at loss "
        f"scale 1 too{rechecked}: the scaler hid a real failure"
    )
    return Verdict(r, StepOutcome.HIDDEN, step=r.step, phase=Phase.BACKWARD, why=why)


def _fmt(x: float) -> str:
    return f"{x:g}" if math.isfinite(x) else str(x)


__all__ = [
    "MAX_SKIP_STREAK",
    "MIN_SCALE",
    "STREAK_CEILING",
    "Judge",
    "Recheck",
    "hidden_failure",
]
