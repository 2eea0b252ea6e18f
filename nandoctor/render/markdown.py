"""The report as Markdown, for a GitHub job summary or a PR comment.

    ## ❌ nandoctor diagnose: non-finite at step 43 (phase loss)
    | where | |
    |---|---|
    | op | `aten.log.default` |
    ...
    ### Why, best first
    1. **log-of-softmax** (93%) ... ✔ verified: ...

Same facts as the JSON and the terminal; nothing is computed here.
"""

from __future__ import annotations

from nandoctor.causes.words import plural, value_word
from nandoctor.render.causes import snippet_pair
from nandoctor.render.forecast import forecast_markdown
from nandoctor.render.origin import library_frames, samples_text, source_line, transient_text
from nandoctor.render.sparkline import sparkline
from nandoctor.report.comparison import CompareRun, Comparison
from nandoctor.report.divergence import divergence_text, divergences, fails_by_divergence
from nandoctor.report.forecast import fails_by_forecast
from nandoctor.report.telemetry import skips_text
from nandoctor.report.types import Cause, Report

ICONS = {"healthy": "✅", "nonfinite": "❌", "interrupted": "⚠️", "timeout": "⚠️"}
VERIFIED = {True: "✔ verified", False: "✘ not enough on its own", None: "not verified"}
_REPRODUCED = {
    "exact": "exact",
    "values-differ": "yes, with other values (nondeterministic)",
    "not-reproduced": "no: transient (the hardware, a race, or nondeterminism)",
}


def render_comparison_markdown(comparison: Comparison) -> str:
    icon = ICONS.get(comparison.status, "⚠️")
    lines = [f"## {icon} nandoctor compare: `{comparison.config}`", "", comparison.verdict, ""]
    lines.append("| | " + " | ".join(r.dtype for r in comparison.runs) + " |")
    lines.append("|---|" + "---|" * len(comparison.runs))
    for label, cell in _COMPARE_ROWS.items():
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in comparison.runs) + " |")
    lines += [""] + [f"- {n}" for n in comparison.notes]
    return "\n".join(lines).rstrip() + "\n"


def _or_dash(value: object, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _headroom(run: CompareRun) -> str:
    """Only where the dtype can overflow: bfloat16 and float32 reach 3.4e38."""
    if not run.headroom or run.dtype != "float16":
        return "-"
    if run.nonfinite_module is not None:
        broke = run.nonfinite_module or "(root)"
        return f"non-finite in `{broke}` at step {run.first_nonfinite_step}"
    top = run.headroom[0]
    return f"{top.peak_fraction:.0%} in `{top.module or '(root)'}`"


_COMPARE_ROWS = {
    "status": lambda r: r.status,
    "clean steps": lambda r: str(r.steps_completed),
    "first non-finite step": lambda r: _or_dash(r.first_nonfinite_step),
    "final loss": lambda r: _or_dash(r.final_loss, "{:.4g}"),
    "max abs loss diff vs float32": lambda r: _or_dash(r.max_abs_loss_diff_vs_reference, "{:.3g}"),
    "median step (ms)": lambda r: _or_dash(r.step_time_ms, "{:.1f}"),
    "fp16 headroom": _headroom,
}


def render_markdown(
    report: Report, divergence_fails: bool = False, forecast_fails: bool = False
) -> str:
    """`divergence_fails`: `--fail-on-divergence` was given, so a finite run that diverged
    is titled failed, as its exit code says; `forecast_fails` (`--fail-on-forecast`): so
    is a healthy run that carries a forecast."""
    lines = [_title(report, divergence_fails, forecast_fails), "", report.summary, ""]
    lines += _environment(report)
    lines += _where(report)
    first = report.first_nonfinite
    line = source_line(first.source) if first is not None else None
    lines += _causes(report.causes, report.environment.grad_scaler, line)
    lines += forecast_markdown(report.forecast, first.step if first is not None else None)
    lines += _gate(report)
    lines += _curves(report)
    if report.notes:
        lines += ["", "**Notes**", ""] + [f"- {n}" for n in report.notes]
    return "\n".join(lines).rstrip() + "\n"


def _title(report: Report, divergence_fails: bool, forecast_fails: bool = False) -> str:
    icon = ICONS.get(report.status, "⚠️")
    first = report.first_nonfinite
    what = f"non-finite at step {first.step} (phase {first.phase})" if first else report.status
    if first is None and report.gate is not None and not report.gate.passed:
        icon, what = ICONS["nonfinite"], "a numeric-health check failed"
    elif fails_by_divergence(report.status, report.events, divergence_fails):
        step = min(e.step for e in divergences(report.events))
        icon, what = ICONS["nonfinite"], f"diverged at step {step} (every step finite)"
    elif first is None and fails_by_forecast(report.forecast, forecast_fails):
        top = report.forecast[0]
        icon, what = ICONS["nonfinite"], f"{top.kind} forecast at step {top.step}"
    name = f" `{report.name}`" if report.name else ""
    return f"## {icon} nandoctor {report.command}{name}: {what}"


def _environment(report: Report) -> list[str]:
    env = report.environment
    scaler = "GradScaler" if env.grad_scaler else "no GradScaler"
    skips = skips_text(report.events)
    return [
        f"`{report.config}` on {env.device}, {env.dtype}, {scaler}, torch {env.torch}, "
        f"{env.threads} threads; {plural(report.steps_completed, 'clean step')}"
        + (f"; {skips}." if skips else "."),
        "",
    ]


def _module(module: str | None, phase: str) -> str:
    if module is not None:
        return module or "(root)"
    return "(none: the batch)" if phase == "input" else "(outside the model)"


def _value(report: Report) -> str | None:
    assert report.first_nonfinite is not None
    output = report.evidence.output if report.evidence is not None else None
    return value_word(report.first_nonfinite.value, output)


def _where(report: Report) -> list[str]:
    first = report.first_nonfinite
    if first is None:
        return []
    rows = [
        ("step", str(first.step)),
        ("phase", first.phase),
        ("module", _module(first.module, first.phase)),
        ("op", first.op),
        ("tensor", first.tensor),
        ("in", samples_text(first.samples)),
        ("value", f"{first.count_nonfinite} × {_value(report)}" if first.value else None),
        ("dtype, shape", f"{first.dtype} {first.shape}" if first.dtype else None),
        ("source", first.source),
        ("via", " ← ".join(library_frames(first)) or None),
        ("reproduced", _REPRODUCED.get(first.reproduced or "")),
    ]
    out = ["| where | |", "|---|---|"]
    out += [f"| {k} | `{v}` |" for k, v in rows if v is not None]
    return [*out, "", *_transients(report)]


def _transients(report: Report) -> list[str]:
    if not report.transients:
        return []
    out = ["**Healed on the way** (seen, not the cause):", ""]
    out += [f"- `{transient_text(t)}`" for t in report.transients]
    return [*out, ""]


def _causes(causes: list[Cause], grad_scaler: bool = True, line: str | None = None) -> list[str]:
    if not causes:
        return []
    out = ["### Why, best first", ""]
    for rank, cause in enumerate(causes, start=1):
        out.append(f"{rank}. **{cause.id}** ({cause.confidence:.0%}): {cause.title}")
        out += [f"   - {line}" for line in cause.evidence]
        out.append(f"   - **fix:** {cause.fix}")
        if cause.verified is not None or cause.verification:
            out.append(
                f"   - **{VERIFIED[cause.verified]}**: {cause.verification or ''}".rstrip(": ")
            )
        if rank == 1:
            out += _snippet(cause.id, grad_scaler, line)
    return [*out, ""]


def _gate(report: Report) -> list[str]:
    if report.gate is None:
        return []
    against = f" against `{report.gate.baseline}`" if report.gate.baseline else ""
    out = [f"### Numeric health{against}", "", "| check | | |", "|---|---|---|"]
    out += [
        f"| {c.name} | {'✅' if c.passed else '❌'} | {c.message} |" for c in report.gate.checks
    ]
    return [*out, ""]


def _snippet(cause_id: str, grad_scaler: bool, line: str | None) -> list[str]:
    block = ["", "   <details><summary>before / after</summary>", ""]
    before, after = snippet_pair(cause_id, grad_scaler, line)
    for label, code in (("before", before), ("after", after)):
        block += [f"   {label}:", "", "   ```python"]
        block += [f"   {line}" for line in code.splitlines()]
        block += ["   ```", ""]
    return [*block, "   </details>"]


def _curves(report: Report) -> list[str]:
    t = report.telemetry
    if not t.step:
        return []
    return [
        "",
        "| curve | steps " + f"{t.step[0]}–{t.step[-1]} |",
        "|---|---|",
        f"| loss | `{sparkline(t.loss, 40)}` |",
        f"| grad norm | `{sparkline(t.grad_norm, 40, log=True)}` |",
        *[f"| divergence | {divergence_text(e)} |" for e in divergences(report.events)],
    ]
