"""Causes named by the phase alone: the batch, or the weights before the step."""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.rules.registry import Hit, rule


@rule("nonfinite-input")
def nonfinite_input(case: Case) -> Hit | None:
    f = case.first
    if f.phase != "input":
        return None
    sentence = (
        f"the batch of step {f.step} held {f.count_nonfinite} {f.value} value(s) in "
        f"{f.tensor} ({f.dtype} {f.shape}) before any op ran"
    )
    return Hit(0.99, [sentence])


@rule("nonfinite-parameters")
def nonfinite_parameters(case: Case) -> Hit | None:
    f = case.first
    if f.phase != "parameters":
        return None
    evidence = [
        f"{f.tensor} held {f.count_nonfinite} {f.value} value(s) before step {f.step} began"
    ]
    if case.facts.checkpoint and f.step == case.facts.start_step:
        evidence.append(f"the weights were loaded from the checkpoint {case.facts.checkpoint}")
    return Hit(0.99 if len(evidence) > 1 else 0.95, evidence)
