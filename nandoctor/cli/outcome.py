"""How a command ended, and the one function that turns that into its exit code.

pytest's `wrap_session` is the model: the engines return their results (a `Report`, a
`Comparison`, a lint result) or raise; each command says what its result means as an
`Outcome`, the wrapper in `app.py` makes one of an exception, and `exit_code` maps
either to SPEC.md's codes. No other module makes an exit code.

| outcome                                                  | exit code               |
|----------------------------------------------------------|-------------------------|
| a usage or config error (`UsageError`, `ConfigError`)    | 2                       |
| the user's code raised (`UserCodeError`), a rank died    | 3                       |
| `diagnose`: the user's code ended the run (status error) | 3                       |
| interrupted: Ctrl-C, SIGTERM, or a report "interrupted"  | 130                     |
| anything else nandoctor did not foresee (a full disk...) | 2 (never 1)             |
| found: non-finite values, a failed gate, lint findings   | 1                       |
| a divergence event, with `--fail-on-divergence`          | 1                       |
| a forecast, with `--fail-on-forecast`                    | 1                       |
| `watch`, nothing found                                   | the command's own code  |
| nothing found                                            | 0                       |

A data-parallel `diagnose` launches one process per rank, each ending with its own code
by this table; `of_ranks` makes the job's code the most telling of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nandoctor.errors import ExitCode, NandoctorError

if TYPE_CHECKING:  # NB: the report's types cost 0.1 s to import, and --help needs none
    from nandoctor.report.comparison import Comparison
    from nandoctor.report.types import Report


@dataclass(frozen=True)
class Outcome:
    """What a command's run amounts to, before it is a number."""

    found: bool = False  # what the command looks for: non-finite values, a failed gate, ...
    interrupted: bool = False
    passthrough: int | None = None  # a code a child process chose (watch's command, the ranks)
    error: BaseException | None = None  # what stopped the command, raised instead of a result


def exit_code(outcome: Outcome) -> int:
    """SPEC.md's exit code of an outcome (see the table above)."""
    if outcome.error is not None:
        return int(_error_code(outcome.error))
    if outcome.interrupted:
        return int(ExitCode.INTERRUPTED)
    if outcome.found:
        return int(ExitCode.NONFINITE)
    if outcome.passthrough is not None:
        return outcome.passthrough
    return int(ExitCode.HEALTHY)


def _error_code(error: BaseException) -> ExitCode:
    if isinstance(error, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(error, NandoctorError):
        return error.exit_code  # the kind of error: usage/config (2) or user code (3)
    return ExitCode.USER_CODE  # torch.distributed's errors: another rank crashed or hung


def of_report(
    report: Report, fail_on_divergence: bool = False, fail_on_forecast: bool = False
) -> Outcome:
    """`diagnose`: a run that did not stay healthy, or failed its gate, found something;
    an interrupted one (also during the replay or the fix replays) says so. With
    `--fail-on-divergence`, a divergence event counts as found too; with
    `--fail-on-forecast`, a forecast."""
    failed_gate = report.gate is not None and not report.gate.passed
    interrupted = report.status == "interrupted"
    if report.status == "error":  # the user's code ended the run (sys.exit): not a NaN
        return Outcome(passthrough=int(ExitCode.USER_CODE), interrupted=interrupted)
    diverged = fail_on_divergence and _diverged(report)
    foreseen = fail_on_forecast and bool(report.forecast)
    found = not report.healthy or failed_gate or diverged or foreseen
    return Outcome(found=found, interrupted=interrupted)


def of_watch(
    report: Report,
    command_code: int,
    fail_on_divergence: bool = False,
    fail_on_forecast: bool = False,
) -> Outcome:
    """`watch`: 1 at a non-finite step (or a divergence, with `--fail-on-divergence`; a
    forecast, with `--fail-on-forecast`); otherwise the watched command's own exit code
    (130 when it was interrupted, whatever it crashed with)."""
    diverged = fail_on_divergence and _diverged(report)
    foreseen = fail_on_forecast and bool(report.forecast)
    found = report.status == "nonfinite" or diverged or foreseen
    return Outcome(found=found, passthrough=command_code)


def of_baseline(report: Report) -> Outcome:
    """`baseline`: only a healthy run is recorded; any other exits 1, an interrupted
    one 130 (SPEC: "130 interrupted", for every command), one the user's code ended 3.
    A run that diverged, though finite, is no baseline either: its peaks would set the
    bar as high as an explosion."""
    if report.status == "error":
        return Outcome(passthrough=int(ExitCode.USER_CODE))
    found = not report.healthy or _diverged(report)
    return Outcome(found=found, interrupted=report.status == "interrupted")


def of_ranks(codes: dict[int, int]) -> Outcome:
    """A data-parallel job, from the exit codes of the ranks that did not exit 0: a crash
    over a usage error over rank 0's verdict (the other ranks exit 0 once done, or are
    stopped when rank 0 is done first)."""
    return Outcome(passthrough=_ranks_code(codes) if codes else None)


def _ranks_code(codes: dict[int, int]) -> int:
    for wanted in (ExitCode.USER_CODE, ExitCode.USAGE):
        if wanted in codes.values():
            return int(wanted)
    if codes.get(0) in (ExitCode.NONFINITE, ExitCode.INTERRUPTED):  # rank 0's verdict
        return codes[0]
    if ExitCode.INTERRUPTED in codes.values():
        return int(ExitCode.INTERRUPTED)
    return int(ExitCode.USER_CODE)  # killed by a signal, or a code nandoctor does not use


def of_comparison(comparison: Comparison) -> Outcome:
    """`compare`: 1 unless every dtype's run stayed healthy; 130 when a run was
    interrupted, 3 when the user's code ended one (the comparison so far is still
    written either way)."""
    status = comparison.status
    if status == "error":  # the user's code ended a run
        return Outcome(passthrough=int(ExitCode.USER_CODE))
    return Outcome(found=not comparison.healthy, interrupted=status == "interrupted")


__all__ = [
    "Outcome",
    "exit_code",
    "of_baseline",
    "of_comparison",
    "of_ranks",
    "of_report",
    "of_watch",
]


def _diverged(report: Report) -> bool:
    from nandoctor.report.divergence import divergences

    return bool(divergences(report.events))
