"""What a callback does with the report of a failed run: write it where the user asked,
and say so in one line on stderr, so that a trainer stopped by `raise_error=False` never
stops silently::

    nandoctor: training stopped at step 3 (non-finite values): step 3, phase input: ...;
    likely cause: nonfinite-input; report written to runs/nan.json

Shared by the Lightning and transformers callbacks; framework-free.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from nandoctor.guard import NonFiniteError
from nandoctor.render.forecast import warning_line
from nandoctor.report.forecast import Forecast
from nandoctor.report.types import Report

NO_PATH = "the report is in callback.report (pass report_path= to write it to a file)"


# The report's note: the callback follows the framework's loop through hooks (the `with`
# form of Guard), which cannot replay a step, and has no step function to give guard.step
CALLBACK_NOTE = (
    "the callback watched the training through hooks and could not replay the step; run "
    "the training under `nandoctor watch -- python train.py` (no callback needed) to have "
    "the tensor, op and source line localised"
)


def deliver(report: Report, path: str | os.PathLike[str] | None) -> str:
    """Write `report` as JSON to `path` (when given); where it is, as the line says it."""
    if path is None:
        return NO_PATH
    write_atomically(Path(path), report.to_json())
    return f"report written to {os.fspath(path)}"


def one_line(report: Report, where: str) -> str:
    """The run's failure, its likely cause and where the report is, in one line."""
    first = report.first_nonfinite
    step = f" at step {first.step}" if first is not None else ""
    top = f"; likely cause: {report.causes[0].id}" if report.causes else ""
    return f"nandoctor: training stopped{step} (non-finite values): {report.summary}{top}; {where}"


def announce(report: Report, where: str, stream: TextIO | None = None) -> None:
    print(one_line(report, where), file=stream if stream is not None else sys.stderr)


def write_atomically(path: Path, text: str) -> None:
    """A temporary file beside `path`, renamed over it: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Handoff:
    """Hands a failed run's report over once: to the file, then to an exception
    (`raise_error`) or to the one line on stderr."""

    def __init__(self, raise_error: bool, report_path: str | os.PathLike[str] | None) -> None:
        self.raise_error = raise_error
        self.report_path = report_path
        self.done = False

    def __call__(self, report: Report) -> None:
        if self.done:
            return
        self.done = True
        where = deliver(report, self.report_path)
        if self.raise_error:
            raise NonFiniteError(report)
        announce(report, where)


def forecast_logger(log: logging.Logger | Any) -> Callable[[Forecast], None]:
    """The guard's `on_forecast` of a callback: one warning through the framework's
    logger, the moment a forecast fires (the report holds it too)."""

    def said(forecast: Forecast) -> None:
        log.warning(warning_line(forecast))

    return said
