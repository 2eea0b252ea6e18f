"""transient-fault: the failure did not reproduce when its step was replayed.

The replay starts from the state the run had before the step (weights, optimizer,
scaler, RNG states, the batch) and runs it again under the tracer; when it meets no
non-finite value, the step's own math did not make the failure, and what is left is a
fault of the hardware, a race, or nondeterminism that decided the outcome
(`first_nonfinite.reproduced: "not-reproduced"`, localize/reproduction.py). Nothing can
be replayed to verify it: the fix is to rerun and to test the machine.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.causes.unit import CauseUnit, Hit, entry
from nandoctor.causes.words import plural

ID = "transient-fault"

INFO = entry(
    ID,
    title="the failure did not reproduce when its step was replayed",
    explanation="""
    The replay of the failing step, from the same weights, batch and random state, met no
    non-finite value: that step's math does not make the failure. What is left is a fault
    of the hardware (a bit flipped in GPU memory or inside a kernel, which ECC catches
    only in memory), a race (two kernels or threads writing the same memory, a collective
    read before its data landed), or nondeterminism that decided whether values overflowed
    (atomic adds whose order changes a sum's last bits, near float16's edge). Megatron-LM
    reruns a step that went NaN for the same reason: a result the same GPU does not give
    again is transient, one it gives again but another GPU does not points at that GPU.
    """,
    fix="""
    Rerun from the last good checkpoint: a failure that does not come back was not in the
    math. If it comes back at another step, make the run deterministic
    (`torch.use_deterministic_algorithms(True)`, `CUBLAS_WORKSPACE_CONFIG=:4096:8`, a
    seeded data order) and diagnose it again; if it comes back on one machine only, test
    that GPU: its ECC error counts (`nvidia-smi -q -d ECC`), Xid errors in `dmesg`, and a
    diagnostic run (`dcgmi diag -r 3`).
    """,
    before="""
    for step, batch in enumerate(loader):  # NaN once, at step 41213, on one node
        train_step(batch)
    """,
    after="""
    import os

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before CUDA starts
    torch.use_deterministic_algorithms(True)  # the same step gives the same bits
    for step, batch in enumerate(loader):  # rerun from the last good checkpoint
        train_step(batch)
    """,
)

NOT_REPRODUCED = "not-reproduced"  # `first_nonfinite.reproduced`'s word for it


def transient_fault(case: Case) -> Hit | None:
    """The replay ran the failing step and met no non-finite value that reached the loss,
    a gradient or a weight. Weights found broken before the step (the `parameters` phase)
    may have been changed between steps on purpose (a checkpoint, an edit): there it
    ranks below `nonfinite-parameters`."""
    f = case.first
    if f.reproduced != NOT_REPRODUCED:
        return None
    healed = (
        " that reached the loss, a gradient or a weight "
        f"({plural(len(case.transients), 'non-finite value')} healed on the way)"
        if case.transients
        else ""
    )
    if f.phase == "parameters":
        sentence = (
            f"the weights were non-finite when step {f.step} began in the run, yet finite "
            f"when the replay of the steps before it began step {f.step}: something changed "
            "them between steps, or memory corrupted them"
        )
        return Hit(0.7, [sentence])
    sentence = (
        f"the replay of step {f.step}, from the same weights, batch and random state, met no "
        f"non-finite value{healed}: the failure did not reproduce"
    )
    return Hit(0.8, [sentence])


CAUSE = CauseUnit(INFO, rule=transient_fault)
