"""The words the rules share: families of ops as the rules think of them, and the way an
evidence sentence says where an op ran and quotes a number.

Kept in one place so that two rules describing the same failure use the same phrases.
"""

from __future__ import annotations

from nandoctor.causes.case import Case
from nandoctor.report.evidence import TensorStats

LOGS = frozenset({"log", "log2", "log10"})
PROBABILITIES = frozenset({"softmax", "sigmoid"})
SOFTMAXES = frozenset({"softmax", "log_softmax"})
ROOTS = frozenset({"sqrt", "rsqrt"})
# ops an exact zero among their inputs makes infinite (x/0, log 0, 0 ** -1): the others
# turn a zero into a NaN only by meeting an inf (0 * inf), which then made the NaN
MEETS_ZERO = LOGS | {"div", "reciprocal", "rsqrt", "pow", "xlogy"}
STEEP_AT_A_POINT = frozenset(
    {
        *("sqrt", "rsqrt", "pow", "norm", "linalg_vector_norm", "acos", "asin", "cdist"),
        *("dist", "std", "xlogy"),
    }
)  # ops whose derivative is infinite (or 0/0: xlogy's in y) where the op itself is finite
OVERFLOWED = ("inf", "-inf", "mixed")  # values of a first non-finite that overflowed


def where(case: Case) -> str:
    """The module and source line of the first bad op: ' in block.fc at model.py:12'."""
    where = f" in {case.first.module or '(root)'}" if case.first.module is not None else ""
    return where + (f" at {case.first.source}" if case.first.source else "")


def num(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"


def plural(n: int | None, word: str, many: str | None = None) -> str:
    """A count and its noun, agreeing: "1 step", "14 steps", "3 exact zeros"; "some steps"
    when the count is unknown (a sentence never reads "None steps" or "1 steps")."""
    if n is None:
        return f"some {many or word + 's'}"
    return f"{n} {word if n == 1 else (many or word + 's')}"


_VALUES = {"nan": "NaN", "inf": "inf", "-inf": "-inf", "mixed": "non-finite"}


def value_word(value: str | None, output: TensorStats | None = None) -> str | None:
    """The report's `value` as a reader says it: "mixed" (more than one kind) names the
    kinds the op's `output` held ("inf and -inf": an overflow both ways made no NaN, and
    "NaN and inf" sent users looking for a 0/0), "NaN or inf" where the kinds were not
    counted; the others as they are."""
    if value != "mixed":
        return value
    if output is None:
        return "NaN or inf"
    counts = (("NaN", output.nan), ("inf", output.posinf), ("-inf", output.neginf))
    kinds = [word for word, n in counts if n]
    if len(kinds) < 2:  # NB: stats of another tensor than the value's: say no more
        return "NaN or inf"
    return ", ".join(kinds[:-1]) + " and " + kinds[-1]


def values(n: int | None, value: str | None) -> str:
    """What a tensor held, in the words of the report's `value` field: "1 NaN value",
    "192 non-finite values", or "non-finite values" when the replay did not count them."""
    kind = _VALUES.get(value or "", "non-finite")
    return plural(n, f"{kind} value") if n is not None else f"{kind} values"


def number_in(scalar: str) -> float:
    """The number of a scalar argument as the tracer wrote it: "other=1e-08" -> 1e-08, and
    of a constant tensor it gave an op: "other=1e-08 (buffer norm.eps)" -> 1e-08."""
    try:
        return float(scalar.split("=", 1)[-1].split(" ", 1)[0])
    except ValueError:
        return 0.0
