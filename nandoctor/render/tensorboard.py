"""`--tensorboard DIR`: a run's telemetry as TensorBoard scalars, beside the user's runs.

    nandoctor diagnose run.yaml --tensorboard runs/nandoctor
    tensorboard --logdir runs

Per step (tags under `nandoctor/`): `loss`, `grad_norm` (unscaled), `loss_scale` (float16
with a GradScaler), `scaler_skips` (the running count of skipped steps); per event:
`events/<kind>` (1 at the step: a scaler skip, a skipped batch; a divergence is written
as `divergence/<metric>` with the value that set it off); per module, where the run
measured it (`compare`, or a gate): `max_abs/<module>` and `max_abs_grad/<module>`, the
peak magnitude, at the step it was seen (else the last step). The forecast's signals, per
step (`diagnose`, `watch`): `forecast/activation_peak`, `forecast/softmax_spread` and
`forecast/attention_logit` (the largest of any module or softmax, as a fraction of its
limit: 1 is the failure), `forecast/update_ratio/param_groups.<i>`,
`forecast/grad_norm_growth` (the norm over the step before's), `forecast/skip_rate` and
`forecast/loss_z`; each forecast is `events/forecast` and a text (`nandoctor/forecast`) at
the step it fired. The failure, when there is
one, is a text summary (`nandoctor/failure`) at its step: what happened and the causes.
`compare` writes one run per dtype, in `DIR/<dtype>`, so they overlay in one chart.

The dependency is optional (`pip install 'nandoctor[tensorboard]'`); without it the
command stops before the run with one line (exit 2). Reads a report, computes nothing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from nandoctor.errors import UsageError
from nandoctor.report.comparison import CompareRun, Comparison
from nandoctor.report.forecast import forecast_text
from nandoctor.report.telemetry import Event, Telemetry
from nandoctor.report.types import Report

PREFIX = "nandoctor"


def require_tensorboard(logdir: str | Path | None = None) -> Any:
    """The SummaryWriter class; a usage error (before any run) when tensorboard is absent
    or `logdir` could not be written (a file there, a folder that is not writable)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError(
            "--tensorboard needs the tensorboard package, which is not installed",
            hint="pip install 'nandoctor[tensorboard]'",
        ) from None
    if logdir is not None:
        _check_logdir(Path(logdir))
    return SummaryWriter


def _check_logdir(logdir: Path) -> None:
    existing = logdir  # NB: the writer makes the missing folders: its nearest existing one
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        which = "" if existing == logdir else f" ({existing})"
        raise UsageError(f"--tensorboard {logdir}: is a file{which}, expected a folder")
    if not os.access(existing, os.W_OK):
        raise UsageError(f"--tensorboard {logdir}: folder {existing} is not writable")


def write_report(report: Report, logdir: str | Path) -> None:
    """One run (diagnose, watch) into `logdir`."""
    with _writer(logdir) as writer:
        _telemetry(writer, report.telemetry, report.events)
        last = report.telemetry.step[-1] if report.telemetry.step else 0
        if report.health is not None:
            for m in report.health.modules:
                _module(writer, m.module, m.activation_absmax, m.gradient_absmax, last)
        _signals(writer, report)
        if report.first_nonfinite is not None:
            writer.add_text(f"{PREFIX}/failure", failure_text(report), report.first_nonfinite.step)


def write_comparison(comparison: Comparison, logdir: str | Path) -> None:
    """One run per dtype, in `logdir/<dtype>`."""
    for run in comparison.runs:
        with _writer(Path(logdir) / run.dtype) as writer:
            _telemetry(writer, run.telemetry, [])
            last = run.telemetry.step[-1] if run.telemetry.step else 0
            for h in run.headroom:
                step = h.activation_step if h.activation_step is not None else last
                _module(writer, h.module, h.activation_absmax, h.gradient_absmax, step)
            if run.first_nonfinite_step is not None:
                writer.add_text(f"{PREFIX}/failure", _run_text(run), run.first_nonfinite_step)


class _writer:
    """A SummaryWriter that is flushed and closed however the writing ends."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            self.writer = require_tensorboard(logdir)(log_dir=str(logdir))
        except OSError as e:  # NB: checked before the run; the disk may have changed since
            raise UsageError(f"--tensorboard {logdir}: {e.strerror or e}") from None

    def __enter__(self) -> Any:
        return self.writer

    def __exit__(self, *exc: object) -> None:
        self.writer.close()


def _telemetry(writer: Any, t: Telemetry, events: list[Event]) -> None:
    skips_by_step: dict[int, int] = {}
    for e in events:
        if e.kind == "scaler-skip":
            skips_by_step[e.step] = skips_by_step.get(e.step, 0) + 1
    skips = 0
    for i, step in enumerate(t.step):
        _scalar(writer, "loss", t.loss[i], step)
        _scalar(writer, "grad_norm", t.grad_norm[i], step)
        if i < len(t.scale) and t.scale[i] is not None:
            _scalar(writer, "loss_scale", t.scale[i], step)
        skips += skips_by_step.get(step, 0)
        if events or skips:
            _scalar(writer, "scaler_skips", skips, step)
    for e in events:
        if e.kind == "divergence":
            _scalar(writer, f"divergence/{e.metric}", e.value, e.step)
        else:
            _scalar(writer, f"events/{e.kind}", 1.0, e.step)


def _signals(writer: Any, report: Report) -> None:
    """The forecast's signals, a point a step, and each forecast as text where it fired."""
    if report.signals is not None:
        for name, (steps, values) in report.signals.points.items():
            for step, value in zip(steps, values, strict=True):
                _scalar(writer, f"forecast/{name}", value, step)
    for f in report.forecast:
        writer.add_text(f"{PREFIX}/forecast", f"**{f.kind}**: {forecast_text(f)}", f.step)


def _module(writer: Any, module: str, act: float, grad: float | None, step: int) -> None:
    _scalar(writer, f"max_abs/{module}", act, step)
    if grad is not None:
        _scalar(writer, f"max_abs_grad/{module}", grad, step)


def _scalar(writer: Any, tag: str, value: float | None, step: int) -> None:
    """NaN and inf are written as they are: TensorBoard shows where the curve broke."""
    if value is not None:
        writer.add_scalar(f"{PREFIX}/{tag}", float(value), int(step))


def failure_text(report: Report) -> str:
    """Markdown, as TensorBoard's text tab renders it."""
    first = report.first_nonfinite
    assert first is not None
    lines = [f"**non-finite at step {first.step}, phase {first.phase}**", "", report.summary]
    for cause in report.causes[:3]:
        lines.append(f"- `{cause.id}` ({cause.confidence:.0%}): {cause.title}. Fix: {cause.fix}")
    return "\n".join(lines)


def _run_text(run: CompareRun) -> str:
    phase = f", phase {run.first_nonfinite_phase}" if run.first_nonfinite_phase else ""
    return f"**{run.dtype}: non-finite at step {run.first_nonfinite_step}{phase}**"
