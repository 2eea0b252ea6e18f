"""nonfinite-parameters: the weights were non-finite before the step began.

Named by the phase alone; a checkpoint the run started from makes it near certain. The
optimizer state a checkpoint holds counts too: its first update writing non-finite
values into that state, the weights and gradients finite, says the state was loaded so. The
what-if replays the run with the non-finite entries of the loaded weights (and optimizer
state) zeroed, to show whether that corruption is the only problem: the run then either
trains, or stays finite without learning (every weight of a layer was lost), or fails
for another reason.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import CauseUnit, Change, Fix, Hit, entry
from nandoctor.causes.words import values

ID = "nonfinite-parameters"

INFO = entry(
    ID,
    title="parameters were non-finite before the step",
    explanation="""
    Weights that are NaN before the forward pass mean the failure happened earlier: a
    checkpoint saved after a silent corruption, an optimizer step that wrote NaN when
    nothing checked, an initialisation that divided by zero. Every step from then on is
    NaN, so the step where it is noticed says nothing about the cause; a NaN weight never
    recovers by more training.
    """,
    fix="""
    Resume from the last checkpoint whose weights are finite, and check
    `torch.isfinite(p).all()` for every parameter (and the optimizer's state tensors)
    before saving: a checkpoint is then known good, and the next failure shows up at the
    step that caused it.
    """,
    before="""
    torch.save(model.state_dict(), "last.pt")
    """,
    after="""
    if all(torch.isfinite(p).all() for p in model.parameters()):
        torch.save(model.state_dict(), "last.pt")
    else:
        raise RuntimeError(f"non-finite weights at step {step}; keeping the previous checkpoint")
    """,
)


def nonfinite_parameters(case: Case) -> Hit | None:
    f = case.first
    if f.phase == "optimizer" and _loaded_state(case):
        # NB: finite weights and gradients, and the first update after loading made the
        # optimizer's own state non-finite: the state it loaded was (Adam's exp_avg_sq)
        state = (f.tensor or "").removeprefix("state:")
        evidence = [
            f"{state} (optimizer state) held {f.value} in the first update after the "
            f"checkpoint {case.facts.checkpoint} was loaded, its weights and gradients finite"
        ]
        return Hit(0.9, evidence)
    if f.phase != "parameters":
        return None
    tensor = f.tensor or "the parameters"
    evidence = [f"{tensor} held {values(f.count_nonfinite, f.value)} before step {f.step} began"]
    if case.facts.checkpoint and f.step == case.facts.start_step:
        evidence.append(f"the weights were loaded from the checkpoint {case.facts.checkpoint}")
    elif f.step == case.facts.start_step:  # NB: no checkpoint to resume from: the builder's
        evidence.append("no checkpoint was loaded: the model was built with them")
        return Hit(0.95, evidence, fix=_BUILT_FIX)
    return Hit(0.99 if len(evidence) > 1 else 0.95, evidence)


_BUILT_FIX = (
    "Find where building the model made them: an initialisation that divides by zero or "
    "takes the log of 0, a weight set by hand, pretrained weights loaded with NaN in them; "
    "check `torch.isfinite(p).all()` for every parameter right after building the model."
)


def _loaded_state(case: Case) -> bool:
    f = case.first
    first_step = f.step == case.facts.start_step and case.facts.checkpoint is not None
    return first_step and (f.tensor or "").startswith("state:")


FIXES = (Fix(change=Change.ZERO_NONFINITE_WEIGHTS),)

CAUSE = CauseUnit(INFO, rule=nonfinite_parameters, fixes=FIXES)
