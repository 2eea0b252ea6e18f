"""The rules: one small function per cause id, reading a `Case`, returning a `Hit` (a
confidence and evidence sentences that quote what was observed) or None.

Rules never look at names of examples or configs; they read the origin op and its inputs,
the ops that made them, the float32 recomputation, module magnitudes, telemetry trends and
the run's settings. Several can hold at once; `rank` orders them, best first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nandoctor.diagnosis import catalog
from nandoctor.diagnosis.case import (
    FLOAT16_MAX,
    FLOAT16_ROUNDS_TO_ZERO,
    Case,
    op_base,
)
from nandoctor.report import Cause

LOGS = frozenset({"log", "log2", "log10"})
PROBABILITIES = frozenset({"softmax", "sigmoid"})
SOFTMAXES = frozenset({"softmax", "log_softmax"})
ROOTS = frozenset({"sqrt", "rsqrt"})
STEEP_AT_A_POINT = frozenset(
    {"sqrt", "rsqrt", "pow", "norm", "linalg_vector_norm", "acos", "asin", "cdist", "dist", "std"}
)  # ops whose derivative is infinite at a point where the op itself is finite


@dataclass(frozen=True)
class Hit:
    confidence: float
    evidence: list[str]


Rule = Callable[[Case], Hit | None]
RULES: dict[str, Rule] = {}


def rule(cause_id: str) -> Callable[[Rule], Rule]:
    """Register a rule under a cause id of the catalog; one rule per id."""

    def register(fn: Rule) -> Rule:
        if cause_id in RULES:
            raise ValueError(f"a rule for {cause_id!r} is registered twice")
        catalog.get(cause_id)  # refuses an id the catalog does not know
        RULES[cause_id] = fn
        return fn

    return register


def rank(case: Case) -> list[Cause]:
    """Every cause whose rule holds, most confident first."""
    causes = []
    for cause_id, fn in RULES.items():
        hit = fn(case)
        if hit is not None:
            info = catalog.get(cause_id)
            causes.append(
                Cause(cause_id, info.title, round(hit.confidence, 2), hit.evidence, info.fix)
            )
    return sorted(causes, key=lambda c: -c.confidence)


def _at(case: Case) -> str:
    where = f" in {case.first.module or '(root)'}" if case.first.module is not None else ""
    return where + (f" at {case.first.source}" if case.first.source else "")


def _num(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


@rule("nonfinite-input")
def nonfinite_input(case: Case) -> Hit | None:
    f = case.first
    if f.phase != "input":
        return None
    return Hit(
        0.99,
        [
            (
                f"the batch of step {f.step} held {f.count_nonfinite} {f.value} value(s) in "
                f"{f.tensor} ({f.dtype} {f.shape}) before any op ran"
            )
        ],
    )


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


@rule("log-of-softmax")
def log_of_softmax(case: Case) -> Hit | None:
    if case.op not in LOGS or case.zeros_in_inputs == 0:
        return None
    producer = case.made_by(PROBABILITIES)
    if producer is None:
        return None
    zeros = case.zeros_in_inputs
    at = f" at {producer.source}" if producer.source else ""
    evidence = [f"{case.first.op} received {zeros} exact zero(s) produced by {producer.op}{at}"]
    if case.first.dtype == "float16":
        evidence.append("in float16 a probability below ~6e-8 rounds to exactly 0; log(0) = -inf")
    return Hit(0.93, evidence)


@rule("log-of-zero")
def log_of_zero(case: Case) -> Hit | None:
    if case.op not in LOGS | {"reciprocal", "rsqrt"} or case.zeros_in_inputs == 0:
        return None
    if case.made_by(PROBABILITIES) is not None or case.first.phase == "backward":
        return None
    made = case.producers(1)
    origin = f" (made by {made[0].op})" if made else ""
    return Hit(
        0.85,
        [
            (
                f"{case.first.op}{_at(case)} met {case.zeros_in_inputs} exact zero(s){origin}: "
                f"the result is {case.first.value}"
            )
        ],
    )


@rule("division-by-zero")
def division_by_zero(case: Case) -> Hit | None:
    denominator = case.input("other")
    if case.op != "div" or case.first.phase not in ("forward", "loss") or denominator is None:
        return None
    if denominator.zeros == 0:
        return None
    made = case.producers(1, feeds="other")
    source = f", made by {made[0].op}" if made else ""
    kind = "0/0 = NaN" if case.first.value == "nan" else "x/0 = inf"
    return Hit(
        0.85,
        [
            (
                f"{case.first.op}{_at(case)} divided by {denominator.zeros} exact zero(s) in its "
                f"denominator{source}: {kind}"
            )
        ],
    )


@rule("eps-underflow")
def eps_underflow(case: Case) -> Hit | None:
    if case.first.phase == "optimizer":
        return _optimizer_eps(case)
    if case.first.dtype != "float16" or case.zeros_in_inputs == 0:
        return None
    for p in case.evidence.producers:
        tiny = [s for s in p.scalars if 0 < abs(_value(s)) < FLOAT16_ROUNDS_TO_ZERO]
        if tiny and op_base(p.op) in ("add", "clamp", "clamp_min", "maximum"):
            return Hit(
                0.9,
                [
                    (
                        f"{p.op} at {p.source} added {tiny[0].split('=')[-1]}, which is 0 in "
                        f"float16 (smallest value ~6e-8), so {case.first.op} still met "
                        f"{case.zeros_in_inputs} exact zero(s)"
                    )
                ],
            )
    return None


def _optimizer_eps(case: Case) -> Hit | None:
    eps, dtype = case.facts.eps, case.facts.param_dtype
    if eps is None or case.op not in ("div", "addcdiv", "sqrt", "add"):
        return None
    if eps == 0:
        return Hit(
            0.9,
            [
                (
                    f"the optimizer {case.facts.optimizer} runs with eps=0: a parameter whose "
                    f"gradient is exactly 0 gets 0/0 = NaN in {case.first.op}"
                )
            ],
        )
    if dtype == "float16" and eps < FLOAT16_ROUNDS_TO_ZERO:
        return Hit(0.9, [f"the optimizer's eps={eps:g} is 0 in the float16 parameters' dtype"])
    return None


@rule("fp16-overflow")
def fp16_overflow(case: Case) -> Hit | None:
    if case.first.dtype != "float16" or case.first.value not in ("inf", "-inf", "mixed"):
        return None
    recompute = case.evidence.recompute
    near = [m for m in case.evidence.modules if (m.activation_absmax or 0) >= 0.5 * FLOAT16_MAX]
    evidence = []
    if recompute is not None and recompute.finite and (recompute.absmax or 0) > FLOAT16_MAX:
        evidence.append(
            f"{case.first.op}{_at(case)} gives |x| up to {_num(recompute.absmax)} in float32, "
            "beyond float16's 65504: it overflowed"
        )
    biggest = max((i.absmax for i in case.evidence.inputs), default=0.0)
    if biggest >= 0.25 * FLOAT16_MAX:
        evidence.append(
            f"its inputs already reached |x| = {_num(biggest)} ({biggest / FLOAT16_MAX:.0%} "
            "of float16's range)"
        )
    evidence += [
        f"module {m.module or '(root)'} ({m.type}) reached |x| = {_num(m.activation_absmax)}"
        for m in near[:2]
    ]
    if not evidence:
        return None
    confidence = 0.9 if len(evidence) > 1 or evidence[0].startswith(case.first.op or "-") else 0.6
    return Hit(confidence - (0.15 if case.first.phase == "backward" else 0.0), evidence)


@rule("exploding-gradients")
def exploding_gradients(case: Case) -> Hit | None:
    """Gradients that grew far beyond their usual size, ahead of the loss."""
    t, clip = case.trends, case.facts.clip_grad_norm
    evidence, confidence = [], 0.0
    if (t.grad_growth or 0) >= 5:
        evidence.append(
            f"the gradient norm grew {t.grad_growth:.3g}x, from {_num(t.grad_early)} early on "
            f"to {_num(t.grad_late)} just before the failure"
        )
        confidence = _gradients_led(case, evidence)
    if _gradient_overflow(case):
        evidence.append(
            f"the gradients themselves overflowed in backward ({case.first.op}{_at(case)})"
        )
        confidence = max(confidence, 0.6)
    if not evidence:
        return None
    if t.late_skips >= 3:
        evidence.append(
            f"the GradScaler skipped {t.late_skips} steps for overflowing gradients after "
            "its first calibration"
        )
        confidence = max(confidence, 0.45)
    if clip is None:
        evidence.append("no gradient clipping is configured")
    else:
        confidence *= 0.5
    return Hit(confidence, evidence)


def _gradients_led(case: Case, evidence: list[str]) -> float:
    """Confidence from which diverged first: the gradients (exploding) or the loss (lr)."""
    t = case.trends
    led = t.grad_onset is not None and (t.loss_onset is None or t.grad_onset < t.loss_onset)
    if led and t.loss_onset is not None:
        evidence.append(
            f"the gradients ran away first, from step {t.grad_onset}; the loss only from "
            f"step {t.loss_onset}"
        )
        return 0.85
    if t.loss_onset is None and (t.loss_late_slope or 0) <= 0 and (t.loss_rise or 1) < 1.3:
        evidence.append("though the loss kept improving: the gradients grew with the model's scale")
        return 0.35
    if led:
        evidence.append(f"the gradients ran away from step {t.grad_onset}")
        return 0.6
    return 0.5


def _gradient_overflow(case: Case) -> bool:
    overflow = case.first.value in ("inf", "-inf", "mixed")
    return case.first.phase == "backward" and overflow and not case.facts.collapsed


@rule("learning-rate-too-high")
def learning_rate_too_high(case: Case) -> Hit | None:
    """The loss diverged first (or with the gradients), or the updates were far too large."""
    t, update = case.trends, case.evidence.update
    evidence, confidence = [], 0.0
    if t.loss_onset is not None and (t.grad_onset is None or t.loss_onset <= t.grad_onset):
        evidence.append(
            f"the loss diverged from step {t.loss_onset}: from its best {_num(t.loss_min)} "
            f"(step {t.loss_min_step}) up to {_num(t.loss_last)}, before or with the gradients"
        )
        confidence = 0.85
    elif (t.loss_rise or 0) >= 2 and (t.loss_late_slope or 0) > 0:
        evidence.append(
            f"the loss climbed from its best {_num(t.loss_min)} (step {t.loss_min_step}) back "
            f"up to {_num(t.loss_last)} before the failure"
        )
        confidence = 0.5
    if update is not None and update.ratio >= 0.03:
        evidence.append(
            f"step {update.step}, the last update before the failure, moved the weights by "
            f"{update.ratio:.1%} of their norm ({update.largest:.1%} for "
            f"{update.largest_param}); about 0.1% is typical"
        )
        confidence = (
            min(0.95, confidence + 0.1) if confidence else (0.5 if update.ratio >= 0.1 else 0.35)
        )
    if not evidence:
        return None
    lr = f" (lr={case.facts.lr:g})" if case.facts.lr else ""
    return Hit(confidence, [*evidence, f"the optimizer is {case.facts.optimizer}{lr}"])


@rule("nondifferentiable-point")
def nondifferentiable_point(case: Case) -> Hit | None:
    if case.first.phase != "backward" or case.backward_of not in STEEP_AT_A_POINT:
        return None
    zeros = case.zeros_in_inputs
    detail = f" (its backward met {zeros} exact zero(s))" if zeros else ""
    return Hit(
        0.9,
        [
            (
                f"the backward of {case.evidence.backward_of}{_at(case)} made "
                f"{case.first.value}{detail}: its derivative is infinite where the forward input "
                "is 0 (or at ±1 for acos/asin), though the forward value is finite"
            )
        ],
    )


@rule("fully-masked-softmax")
def fully_masked_softmax(case: Case) -> Hit | None:
    if case.op not in SOFTMAXES | {"sub", "exp"} or not case.created_nan:
        return None
    masked = sum(i.neginf for i in case.evidence.inputs)
    if masked == 0:
        return None
    confidence = 0.92 if case.op in SOFTMAXES else 0.7
    return Hit(
        confidence,
        [
            (
                f"{case.first.op}{_at(case)} received {masked} -inf value(s) and made "
                f"{case.first.count_nonfinite} NaN: a row that is entirely -inf gives "
                "exp(-inf)/sum = 0/0"
            )
        ],
    )


@rule("grad-scaler-collapse")
def grad_scaler_collapse(case: Case) -> Hit | None:
    if not case.facts.collapsed:
        return None
    evidence = [case.facts.collapse_why]
    overflow = case.first.value in ("inf", "-inf", "mixed") and case.first.phase == "backward"
    if overflow:
        evidence.append(
            f"even at that scale, {case.first.op}{_at(case)} overflowed float16 in backward: "
            "the unscaled gradients exceed 65504"
        )
    return Hit(0.88 if overflow else 0.6, evidence)


@rule("invalid-domain")
def invalid_domain(case: Case) -> Hit | None:
    if not case.created_nan:
        return None
    x = case.input("self")
    if x is None:
        return None
    if case.op in LOGS | ROOTS and x.negatives > 0 and x.min < 0:
        return Hit(
            0.92,
            [
                (
                    f"{case.first.op}{_at(case)} received {x.negatives} negative value(s) (min "
                    f"{_num(x.min)}): NaN"
                )
            ],
        )
    if case.op in ("acos", "asin") and x.absmax > 1:
        return Hit(
            0.92,
            [
                (
                    f"{case.first.op}{_at(case)} received values beyond [-1, 1] (|x| up to "
                    f"{x.absmax:.6g}): NaN"
                )
            ],
        )
    if case.op == "log1p" and x.min < -1:
        return Hit(
            0.92, [f"{case.first.op}{_at(case)} received values below -1 (min {_num(x.min)}): NaN"]
        )
    return None


def _value(scalar: str) -> float:
    try:
        return float(scalar.split("=", 1)[-1])
    except ValueError:
        return 0.0
