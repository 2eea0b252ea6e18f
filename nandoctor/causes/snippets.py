"""A cause's before/after snippet in the run's own terms: without GradScaler lines for a
run that has no scaler.

The catalog writes its snippets for the mixed-precision loop (`scaler.scale(loss)
.backward()` ... `scaler.step(opt)`), the most general form. Shown to a float32 or
bfloat16 run, those lines would ask the user to add a scaler they do not need, so each
scaler call becomes the plain call it wraps and `update`/`unscale_` lines go. Snippets
about the scaler itself (they build one, or the change is the scaler call) stay as written.

Where the failure's source line is known, a cause whose fix is a local edit shows that
edit on the user's own line: `y = (x - m) / x.std(0)` becomes
`y = (x - m) / x.std(0).clamp_min(1e-6)` (division-by-zero: the reduction in the
denominator is bounded; `.sum()`/`.count_nonzero()` by 1, the others by 1e-6).
"""

from __future__ import annotations

import re

# a reduction after the last `/` of a line, not already bounded
_DENOMINATOR = re.compile(
    r"/\s*(?P<expr>[\w.\[\]]+\.(?P<op>std|var|norm|sum|mean|count_nonzero)\((?:[^()]|\([^()]*\))*\))"
    r"(?!\s*\.clamp)"
)
_BOUND = {"sum": "1", "count_nonzero": "1"}

_SCALE = re.compile(r"\b(\w+)\.scale\((.+?)\)\.backward\(\)")
_STEP = re.compile(r"\b\w*scaler\w*\.step\((\w+)\)")
_DROPPED = re.compile(r"^\s*\w*scaler\w*\.(update|unscale_)\(.*\)\s*(#.*)?$")
_SCALER_COMMENT = re.compile(r"\s*#.*\b(skip\w*|scaler|unscale|loss scale)\b.*$", re.IGNORECASE)


def for_run(before: str, after: str, grad_scaler: bool) -> tuple[str, str]:
    """The (before, after) pair as it applies to a run with (unchanged) or without a
    GradScaler."""
    if grad_scaler or "GradScaler(" in before + after:
        return before, after
    plain = without_scaler(before), without_scaler(after)
    return (before, after) if plain[0] == plain[1] else plain


def without_scaler(code: str) -> str:
    lines = []
    for line in code.splitlines():
        if _DROPPED.match(line):
            continue
        plain = _STEP.sub(r"\1.step()", _SCALE.sub(r"\2.backward()", line))
        if plain != line:
            plain = _SCALER_COMMENT.sub("", plain)
        lines.append(plain)
    return "\n".join(lines)


def on_user_line(cause_id: str, line: str) -> tuple[str, str] | None:
    """(before, after) on the user's own line, or None when the fix is not a local edit
    this can write."""
    if cause_id != "division-by-zero":
        return None
    code = line.split("  #")[0].strip()  # NB: a trailing comment is the user's note
    matches = list(_DENOMINATOR.finditer(code))
    if not matches:
        return None
    m = matches[-1]
    bound = _BOUND.get(m.group("op"), "1e-6")
    fixed = code[: m.end("expr")] + f".clamp_min({bound})" + code[m.end("expr") :]
    return code, fixed
