"""What one cause module declares: its text, its rule and its fix plan, as one `CauseUnit`.

A module per cause id keeps everything about a cause in one file (ruff keeps one rule per
file for the same reason): the words a user reads (`CauseInfo`), the function that
recognises the cause in a `Case` (`Rule`, returning a `Hit`), and the what-if fixes that
nandoctor can replay for it (`Fix`), written as data so that the docs can list them and the
what-if engine (diagnose/verify.py) can apply them without the causes knowing how.
Nothing here imports torch.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from nandoctor.causes.case import Case


@dataclass(frozen=True)
class CauseInfo:
    """One cause: what it is, why it produces non-finite values, and what to do instead.

    `fix` gives the remedy and the reason in one sentence; `before` and `after` are small,
    realistic snippets (they parse, though they use names such as `model` they don't define).
    """

    id: str
    title: str
    explanation: str
    fix: str
    before: str
    after: str


def entry(id: str, title: str, explanation: str, fix: str, before: str, after: str) -> CauseInfo:
    """A catalog entry from text written as indented triple-quoted blocks: prose is joined
    into one line (Markdown and terminals wrap it), snippets are dedented."""
    return CauseInfo(
        id=id,
        title=title,
        explanation=" ".join(explanation.split()),
        fix=" ".join(fix.split()),
        before=textwrap.dedent(before).strip("\n"),
        after=textwrap.dedent(after).strip("\n"),
    )


@dataclass(frozen=True)
class Hit:
    """A rule's finding: how confident, and the observed facts that say so, as sentences.

    `fix`, when given, replaces the catalog's fix sentence in this report: a remedy that
    quotes this run's numbers (the learning rate in effect, not the config's).
    """

    confidence: float
    evidence: list[str]
    fix: str | None = None


Rule = Callable[[Case], Hit | None]


class Change(str, Enum):
    """A change to the run's config that a what-if replay can make; the value says what it
    does (docs/causes.md shows it). diagnose/plans.py holds how each is applied, and when
    it cannot be (a bfloat16 switch needs a float16 run, a smaller lr a numeric `lr`)."""

    BFLOAT16 = "bfloat16 autocast instead of float16"
    CLIP_GRAD_NORM = "unscale_ then clip_grad_norm_(1.0)"
    SMALLER_LR = "a 10x smaller learning rate"
    OPTIMIZER_EPS = "the optimizer's eps raised to what the parameters' dtype holds"
    SKIP_NONFINITE_BATCHES = "batches holding NaN or inf skipped"
    ZERO_NONFINITE_WEIGHTS = "the non-finite entries of the loaded weights zeroed"


@dataclass(frozen=True)
class Fix:
    """One what-if fix: a config change, the cause's math patch, or both; or the guard.

    `patch` means the patch registered under this cause's id in runtime/patches.py (a probe
    that rewrites the math while the replay runs). `guard` means "guard the origin op": the
    op the replay named, at the user's source line it named, made safe for the whole run
    (runtime/patches.OriginGuardPatch). `phases` limits the fix to failures first seen in
    those phases. A cause lists its fixes in order: those whose phases hold are replayed
    one after the other until one holds (diagnose/verify.py), so a cheap or specific fix
    comes first and a broader one after it.
    """

    change: Change | None = None
    patch: bool = False
    guard: bool = False
    phases: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.change is None and not self.patch and not self.guard:
            raise ValueError("a Fix changes the config, patches the math, or guards the op")
        if self.guard and (self.change is not None or self.patch):
            raise ValueError("the guard of the origin op is a fix on its own")

    def holds_in(self, phase: str) -> bool:
        return self.phases is None or phase in self.phases


FixPlan = tuple[Fix, ...]


def fix_for(fixes: FixPlan, phase: str) -> Fix | None:
    """The fix to replay for a failure first seen in `phase`: the first whose phases hold."""
    return next((f for f in fixes if f.holds_in(phase)), None)


def fixes_for(fixes: FixPlan, phase: str) -> list[Fix]:
    """Every fix that may be replayed for a failure first seen in `phase`, in order."""
    return [f for f in fixes if f.holds_in(phase)]


GUARD_ORIGIN = Fix(guard=True)  # the fix plan's entry for "guard the origin op"


@dataclass(frozen=True)
class CauseUnit:
    """Everything about one cause id: `rule` is None for a cause only lint looks for,
    `fixes` empty where nandoctor cannot apply a fix itself (the data, a checkpoint)."""

    info: CauseInfo
    rule: Rule | None = None
    fixes: FixPlan = ()

    @property
    def id(self) -> str:
        return self.info.id
