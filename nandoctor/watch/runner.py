"""`nandoctor watch -- CMD...`: run any command with the sentinel attached to every Python
process it starts, and turn what they saw into the report of `diagnose`.

The command runs as a subprocess, from an argument list (never a shell string), with
two changes to its environment: `boot/` first on PYTHONPATH, whose `sitecustomize`
attaches the sentinel as soon as a process imports torch, and `NANDOCTOR_WATCH` holding
the settings (see `protocol`). So `python train.py`, `python -m pkg.train`, `torchrun`
or a shell script that ends in Python are all watched the same way, unchanged.

When a run fails and the time it took to fail fits the replay budget, the command runs
a second time, stopping at the bad step, which runs under the tracer: that replay names
the op, module, tensor and source line, as `diagnose`'s replay does. It needs the script
to be deterministic (seeded); when it is not, the report says so.
"""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from nandoctor.diagnose.assemble import Findings, assemble
from nandoctor.diagnose.explain import causes_of
from nandoctor.diagnose.summary import REPLAY_INTERRUPTED
from nandoctor.errors import ExitCode
from nandoctor.localize.replay import Localization, localize_failure
from nandoctor.report.types import Environment, Report
from nandoctor.runtime.hooks import CLIP_BEFORE_UNSCALE
from nandoctor.runtime.record import RunResult, RunStatus
from nandoctor.watch import recheck, results
from nandoctor.watch.process import TIMED_OUT_CODE, run_command
from nandoctor.watch.protocol import DEFAULT_REPLAY_BUDGET, Settings
from nandoctor.watch.ranks import JobRanks, job_ranks

# A rerun that takes longer than RERUN_MIN_S, and than 3x the first run's time to fail
# plus RERUN_SLACK_S, is stopped (it would wait for a shared resource, or never end)
RERUN_MIN_S = 60.0
RERUN_SLACK_S = 30.0


@dataclass(frozen=True)
class WatchOptions:
    replay: bool = True
    replay_budget: float = DEFAULT_REPLAY_BUDGET
    stdout_to_stderr: bool = False  # the report goes to stdout (`--json -`): keep it clean
    kept_going: bool = False  # --continue: the script ran to its end (its files are final)


@dataclass(frozen=True)
class Watched:
    """What the watch found, and how the command itself ended; the CLI makes the exit
    code of the two (the command's own, unless a non-finite value was found)."""

    report: Report
    # the command's exit code (128+N for signal N, 130 when interrupted), or 3 (the user's
    # code raised) when it failed because one of its processes died of an exception
    command_code: int


def watched(
    command: list[str],
    folder: str,
    code: int,
    options: WatchOptions = WatchOptions(),
    on_replay: Callable[[int], None] | None = None,
) -> Watched:
    """What the command's processes saw, run watched in `folder` until it exited with
    `code` (`process.run_command`), with its failure replayed. NB: the first run is the
    caller's, so that the command starts before this module (and torch) is imported."""
    runs, attached = results.load_runs(folder), results.attached(folder)
    raised = results.raised(folder) if code not in (0, ExitCode.INTERRUPTED) else None
    first = runs[0] if runs else None
    failure = first.result.failure if first is not None else None
    located: Localization | None = None
    notes: list[str] = []
    traces: list[results.Trace] = []
    interrupted = None
    if code == ExitCode.INTERRUPTED and failure is not None:  # NB: Ctrl-C after the failure
        notes = [f"no replay: the command was interrupted; {_RERUN_HINT}"]
    elif first is not None and failure is not None and failure.step is not None:
        try:
            first, notes = _maybe_recheck(command, first, runs, options)
            located, more, result = _maybe_replay(command, first.result, options, on_replay, traces)
            first, notes = replace(first, result=result), notes + more
            runs = [first, *runs[1:]]  # NB: its failure as the replay placed it, for the ranks
            if located is not None and traces and traces[0].rank != first.rank:
                # NB: a job's replay traced by another rank than the run that failed
                # first: its losses are another process's, nothing to hold them against
                located = replace(located, losses={})
        except KeyboardInterrupt:  # NB: Ctrl-C (or SIGTERM) while the rerun ran
            interrupted = REPLAY_INTERRUPTED
    job = None
    if first is not None and failure is not None and failure.step is not None:
        job = job_ranks(runs, failure.step, traces)
        notes += _stopped_note(runs, failure.step, folder, job)
    report = _report(command, first, code, located, notes, attached, interrupted, raised, job)
    if interrupted:
        return Watched(report, int(ExitCode.INTERRUPTED))
    return Watched(report, int(ExitCode.USER_CODE) if raised is not None else code)


def _maybe_recheck(
    command: list[str],
    first: results.ChildRun,
    runs: list[results.ChildRun],
    options: WatchOptions,
) -> tuple[results.ChildRun, list[str]]:
    """A collapse of the GradScaler's scale, from skips nothing could recheck: the command
    run again, each of those skips rechecked at loss scale 1 (`recheck`). The first that
    was no overflow is the failure, where the scaler began hiding it."""
    steps = recheck.steps_to_recheck(first.result)
    several = any(r.rank is not None for r in runs)  # NB: a job of ranks: not rechecked
    fits = options.replay and not options.kept_going
    fits = fits and first.result.seconds <= options.replay_budget
    if not steps or several or not fits:
        return first, []
    timeout = max(RERUN_MIN_S, 3 * first.result.seconds + RERUN_SLACK_S)
    with tempfile.TemporaryDirectory(prefix="nandoctor-recheck-") as folder:
        settings = Settings(folder, recheck_steps=steps)
        log = Path(folder) / "recheck.log"
        run_command(command, settings, log=log, timeout=timeout, interrupt_raises=True)
        answers = results.load_rechecks(folder)
        last = _last_line(log)
    unchecked = "the GradScaler's skips could not be rechecked at loss scale 1"
    if not answers:
        tail = f"; its last output: {last}" if last else ""
        return first, [f"{unchecked}: the rerun of the command rechecked none{tail}"]
    if (other := next((s for s, (skipped, _) in answers.items() if not skipped), None)) is not None:
        return first, [
            f"{unchecked}: the rerun of the command did not skip step {other}, as the first run "
            "did, so the script is not deterministic: seed Python, numpy and torch, and fix "
            "its data order"
        ]
    result = recheck.with_answers(first.result, {s: bad for s, (_, bad) in answers.items()})
    return replace(first, result=result), []


def _maybe_replay(
    command: list[str],
    result: RunResult,
    options: WatchOptions,
    on_replay,
    traces: list[results.Trace],
) -> tuple[Localization | None, list[str], RunResult]:
    """The failure replayed (`traces`: every process's replay of the step, filled in),
    and the run with the failure the replay placed (a new result: it may move a step back)."""
    failure = result.failure
    assert failure is not None and failure.step is not None
    why_not = _no_replay(result, options)
    if why_not is not None:
        return None, [why_not], result
    if on_replay is not None:
        on_replay(failure.step)
    timeout = max(RERUN_MIN_S, 3 * result.seconds + RERUN_SLACK_S)

    def replay(step: int, loss_scale: float | None) -> Localization:
        """The command run again with the tracer armed at `step` (a script cannot be
        rewound: `diagnose`'s localisation, with a rerun for a rewind)."""
        with tempfile.TemporaryDirectory(prefix="nandoctor-replay-") as folder:
            settings = Settings(folder, trace_step=step, loss_scale=loss_scale)
            log = Path(folder) / "replay.log"
            code = run_command(command, settings, log=log, timeout=timeout, interrupt_raises=True)
            stopped = _rerun_limit(timeout) if code == TIMED_OUT_CODE else None
            traces[:] = results.load_traces(folder)
            return results.located_of(traces, step, _last_line(log), stopped_after=stopped)

    located, failure = localize_failure(failure, result.start_step, replay)
    return located, [], replace(result, failure=failure)


def _no_replay(result: RunResult, options: WatchOptions) -> str | None:
    """Why the failure is not replayed (the report's note), or None when it is."""
    if not options.replay:
        return f"no replay (--no-replay): {_RERUN_HINT}"
    if options.kept_going:
        return (
            "no replay after --continue: a rerun would repeat the script's side effects (its "
            "checkpoints, its logs) over those of the run that went on to its end; "
            f"{_RERUN_HINT} (rerun without --continue for them)"
        )
    if result.seconds > options.replay_budget:
        return (
            f"no replay: the command took {_seconds(result.seconds)} to fail, more than the "
            f"replay budget of {_seconds(options.replay_budget)} (--replay-budget); {_RERUN_HINT}"
        )
    return None


def _rerun_limit(timeout: float) -> str:
    return (
        f"{_seconds(timeout)} (a rerun may take 3x the first run's time to fail plus "
        f"{_seconds(RERUN_SLACK_S)}, and at least {_seconds(RERUN_MIN_S)})"
    )


def _seconds(value: float) -> str:
    """`12 s`, `1.3 s`: under 10 s a tenth shows (a 1.3 s run, a budget of 0.9 s)."""
    return f"{value:.0f} s" if value >= 10 or value == int(value) else f"{value:.1f} s"


def _last_line(log: Path) -> str:
    """The rerun's output is hidden; when it ended early, its last line says why."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else ""


_RERUN_HINT = "the report names the step and phase, not the tensor"


def _report(
    command: list[str],
    first: results.ChildRun | None,
    code: int,
    located: Localization | None,
    notes: list[str],
    attached: bool,
    interrupted: str | None = None,
    raised: str | None = None,
    job: JobRanks | None = None,
) -> Report:
    """The report of the first process that stepped (the failing one first), decided
    with the command's own exit code (see `assemble.status_of`); `interrupted`: what an
    interrupt cut short (the replay); `raised`: the exception the command died of."""
    if first is None:
        result = RunResult(RunStatus.HEALTHY, 0, 0)
        notes = [*notes, _not_attached(code) if not attached else "no optimizer step was seen"]
        env = Environment("unknown", torch.__version__, "unknown", False, 0)
        facts = None
    else:
        result, env, facts = first.result, first.environment, first.facts
    if job is not None and result.failure is not None:
        result = replace(result, failure=job.on(result.failure))
    if facts is not None and facts.clipped_scaled is not None and result.failure is None:
        # NB: a healthy run has no causes: the loop's clip-before-unscale is said here
        notes.append(CLIP_BEFORE_UNSCALE.format(step=facts.clipped_scaled))
    if code != 0 and result.failure is None and code != ExitCode.INTERRUPTED:
        died = f": it raised {raised}" if raised is not None else ""
        notes.append(f"the command exited with code {code}{died}")
    findings = Findings(
        "watch",
        shlex.join(command),
        env,
        result,
        notes=notes,
        located=located,
        causes=causes_of(result, located, facts),
        command_code=code,
        interrupted=interrupted,
        world_size=job.world_size if job is not None else None,
        per_rank=job.per_rank if job is not None else None,
    )
    return assemble(findings)


def _stopped_note(
    runs: list[results.ChildRun], step: int, folder: str, job: JobRanks | None
) -> list[str]:
    """A job of several ranks that nandoctor stopped at its failure: its launcher then
    reports the stop as a crash (the other ranks' broken connections, torchrun's
    `ChildFailedError`), printed before the report; the report says where that came from."""
    world = next((r.world_size for r in runs if r.world_size is not None), None)
    if world is None or not results.stopped(folder):
        return []
    where = f" on rank {', '.join(map(str, job.origin))}" if job is not None else ""
    return [
        f"nandoctor stopped the job at step {step}, where it went non-finite{where}: the "
        "launcher's errors printed before this report (a peer's closed connection, "
        "ChildFailedError, a rank's exit code 1) follow from that stop, not from a crash"
    ]


def _not_attached(code: int) -> str:
    """Why no sentinel watched: a command that failed early (a missing script, a bad
    argument) ended before torch; one that ran to its end may not be a Python that
    has nandoctor installed."""
    if code not in (0, ExitCode.INTERRUPTED):
        return (
            "nandoctor was not attached: the command ended before any process of it imported torch"
        )
    return (
        "nandoctor was not attached: no process of the command imported torch with "
        "nandoctor importable (is it a Python with nandoctor installed?)"
    )
