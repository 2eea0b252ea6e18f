"""`nandoctor diagnose CONFIG`: replay, stop at the first bad step, say where and why;
with `--baseline`, gate the run's numeric health against a recorded healthy run."""

from __future__ import annotations

import dataclasses
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from nandoctor.cli import options
from nandoctor.cli.app import app, cli_console, handles_errors, stderr_console
from nandoctor.cli.outcome import Outcome, of_ranks, of_report
from nandoctor.cli.output import write_text
from nandoctor.diagnose.budgets import DEFAULT_VERIFY_BUDGET
from nandoctor.errors import ConfigError, RankDied, UsageError, UserCodeError
from nandoctor.gate.tolerances import Tolerances

if TYPE_CHECKING:
    from nandoctor.diagnose.engine import DiagnoseOptions
    from nandoctor.report.types import Report
    from nandoctor.setup.load import LoadedConfig

DEFAULTS = Tolerances()


@app.command()
@handles_errors
def diagnose(
    config: Path = typer.Argument(..., help="The run's YAML config."),
    steps: int | None = options.Steps,
    device: str | None = options.Device,
    dtype: str | None = options.Dtype,
    autocast_policy: str | None = options.AutocastPolicy,
    seed: int | None = options.Seed,
    json_path: str | None = options.Json,
    markdown_path: str | None = options.Markdown,
    junit_path: str | None = options.Junit,
    no_verify: bool = typer.Option(False, "--no-verify", help="Do not replay the fixes."),
    verify_budget: float = typer.Option(
        DEFAULT_VERIFY_BUDGET,
        "--verify-budget",
        min=0,
        callback=options.a_number,
        help="Seconds for all fix replays.",
    ),
    verify_from_start: bool = typer.Option(
        False,
        "--verify-from-start",
        help="Replay every fix refuted from the snapshot again from the run's start, "
        "whatever it costs (within --verify-budget).",
    ),
    time_budget: float | None = options.TimeBudget,
    baseline: str | None = typer.Option(None, "--baseline", help="Gate on this baseline file."),
    max_headroom: float | None = typer.Option(
        None,
        "--max-headroom",
        min=0,
        callback=options.a_number,
        help="Largest fraction of 65504 allowed (default 0.5, float16 runs).",
    ),
    max_activation_growth: float | None = typer.Option(
        DEFAULTS.max_activation_growth,
        min=1,
        callback=options.a_number,
        help="Opt-in: per-module activation peak growth.",
    ),
    max_gradient_growth: float | None = typer.Option(
        DEFAULTS.max_gradient_growth,
        min=1,
        callback=options.a_number,
        help="Opt-in: per-module gradient and p90 growth.",
    ),
    skip_streak_margin: int = typer.Option(
        DEFAULTS.skip_streak_margin,
        min=0,
        help="GradScaler skips in a row allowed beyond the baseline's longest streak.",
    ),
    max_loss_increase: float | None = typer.Option(
        DEFAULTS.max_loss_increase,
        min=0,
        callback=options.a_number,
        help="Opt-in: relative final-loss increase.",
    ),
    max_headroom_loss: float = typer.Option(
        DEFAULTS.max_headroom_loss,
        min=1,
        callback=options.a_number,
        help="A module's peak over the baseline's, where it is above 1/64 of the dtype's range.",
    ),
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", min=1, help="Data-parallel processes (torchrun's launcher)."
    ),
    quiet: bool = options.Quiet,
    debug: bool = options.Debug,
    tensorboard_dir: str | None = options.TensorBoard,
    fail_on_divergence: bool = options.FailOnDivergence,
    fail_on_forecast: bool = options.FailOnForecast,
) -> Outcome:
    """Replay the run, stop at the first non-finite step, and say where and why."""
    # NB: imported here, so that --help stays free of torch (SPEC: --help in 0.5 s)
    from nandoctor.diagnose import engine
    from nandoctor.gate.baseline import read_baseline
    from nandoctor.render import tensorboard
    from nandoctor.render.terminal import render_report
    from nandoctor.setup import distributed
    from nandoctor.setup.load import load_config

    outputs = {"--json": json_path, "--markdown": markdown_path, "--junit": junit_path}
    options.check_outputs(outputs)
    tensorboard_dir = options.checked_logdir(tensorboard_dir, outputs)
    loaded = load_config(config).with_overrides(
        steps=steps, device=device, dtype=dtype, seed=seed, autocast_policy=autocast_policy
    )
    options.protect_inputs(outputs, loaded, baseline=baseline)
    nproc = nproc_per_node or loaded.config.distributed.nproc_per_node
    if nproc > 1 and time_budget is not None:  # NB: before the launch, not once a rank
        raise UsageError("--time-budget is not supported in distributed runs yet; use --steps")
    if nproc > 1 and not distributed.under_launcher():
        return launch_ranks(loaded, nproc)
    if distributed.current_rank() != 0:  # rank 0 speaks for the job
        quiet, outputs = True, {}
    tolerances = Tolerances(
        max_headroom,
        max_activation_growth,
        max_gradient_growth,
        skip_streak_margin,
        max_loss_increase,
        max_headroom_loss=max_headroom_loss,
    )
    settings = engine.DiagnoseOptions(
        verify=not no_verify,
        verify_budget=verify_budget,
        verify_from_start=verify_from_start,
        measure_health=bool(junit_path) or max_headroom is not None,
        baseline=read_baseline(baseline) if baseline is not None else None,
        baseline_path=baseline,
        tolerances=tolerances,
        time_budget=time_budget,
    )
    console = cli_console(stderr=options.report_console_to_stderr(*outputs.values()))
    try:
        report = run_with_progress(console, "diagnose", str(config), loaded, settings, quiet)
    except KeyboardInterrupt:  # still building the run: the report says nothing ran
        write_reports(engine.interrupted_before_the_run(loaded), outputs)
        raise
    except UserCodeError as e:  # NB: raised during the run: its report first (exit 3)
        if e.report is not None:  # NB: set in a single process only (`fast_run`)
            write_reports(e.report, outputs)
        raise
    except engine.ReplayOutOfMemory as e:  # NB: what the run saw stands: shown and written
        if distributed.current_rank() == 0:
            render_report(console, e.report, quiet=quiet, divergence_fails=fail_on_divergence)
            write_reports(e.report, outputs, fail_on_divergence)
        raise
    if distributed.current_rank() != 0:  # rank 0 speaks for the job; the others end quietly
        return Outcome()
    report = _stopped_by_a_peer(report)
    render_report(
        console,
        report,
        quiet=quiet,
        divergence_fails=fail_on_divergence,
        forecast_fails=fail_on_forecast,
    )
    if tensorboard_dir:
        tensorboard.write_report(report, tensorboard_dir)
    write_reports(report, outputs, fail_on_divergence, fail_on_forecast)
    return of_report(report, fail_on_divergence, fail_on_forecast)


def _stopped_by_a_peer(report: Report) -> Report:
    """Rank 0 stopped by the launcher (SIGTERM, read as an interrupt) because another rank
    failed (a hang it timed out on, its own error): the job failed (exit 3), it was not
    cancelled, and the report says so with that rank's reason."""
    from nandoctor.setup import distributed

    if report.status != "interrupted" or not distributed.under_launcher():
        return report
    why = distributed.failed_peer()
    if why is None:
        return report
    summary = f"stopped after {report.steps_completed} steps because another rank failed"
    note = f"the job's launcher stopped rank 0 after this error: {why}"
    return dataclasses.replace(report, status="error", summary=summary, notes=[*report.notes, note])


def launch_ranks(loaded: LoadedConfig, nproc: int) -> Outcome:
    """Run the job on `nproc` ranks; a rank killed by a signal is named (exit 3), and a
    Ctrl-C or SIGTERM of the launcher is an interrupt (130; rank 0 writes its report).
    What every rank would refuse alike is refused first, once for the job."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from nandoctor.setup import distributed

    try:
        distributed.check_backend(loaded.config.distributed, loaded.config.device)
    except ConfigError as e:
        raise loaded.placed(e) from None
    try:
        codes = distributed.launch(sys.argv[1:], nproc)
    except SignalException:
        stderr_console().print("interrupted", style="yellow")
        return Outcome(interrupted=True)
    killed = {r: -c for r, c in codes.items() if c < 0 and c != -signal.SIGTERM}
    if killed:
        rank, signum = first_death(killed)
        raise RankDied(f"rank {rank} died: killed by {_signal_name(signum)}")
    return of_ranks(codes)


def first_death(killed: dict[int, int]) -> tuple[int, int]:
    """The rank whose death to name, of those killed by a signal (rank -> signal number).

    NB: a rank that lost its peer ends with its own error, but gloo's threads may then
    abort it as Python tears down ("terminate called without an active exception":
    SIGABRT). That death follows the other; a rank killed by anything else is named first,
    the lowest such rank where there are several."""
    primary = {r: s for r, s in killed.items() if s != signal.SIGABRT}
    return min((primary or killed).items())


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def run_with_progress(
    console: Console,
    command: str,
    shown_path: str,
    loaded: LoadedConfig,
    settings: DiagnoseOptions,
    quiet: bool,
) -> Report:
    from nandoctor.diagnose import engine
    from nandoctor.render.terminal import StepProgress, print_header
    from nandoctor.render.verifying import FixProgress
    from nandoctor.runtime.host_memory import keep_freed_memory

    keep_freed_memory()  # NB: the loop runs in this process: its steps reuse what they free
    progress = StepProgress(console, loaded.config.steps, enabled=not quiet)
    fixes = FixProgress(console, enabled=not quiet)

    def on_session(session) -> None:
        if not quiet:
            print_header(console, command, shown_path, session)
        progress.__enter__()

    def on_causes(report: Report) -> None:  # NB: where and why first, then the replays
        progress.__exit__(None, None, None)
        fixes.located(report)

    try:
        return engine.diagnose(
            loaded,
            settings,
            on_session=on_session,
            on_step=progress.update,
            on_causes=on_causes,
            on_replay=fixes.replay,
            on_replay_step=fixes.step,
        )
    finally:
        progress.__exit__(None, None, None)
        fixes.stop()


def write_reports(
    report: Report,
    outputs: dict[str, str | None],
    divergence_fails: bool = False,
    forecast_fails: bool = False,
) -> None:
    """Every report asked for, each written atomically; `divergence_fails`
    (`--fail-on-divergence`) and `forecast_fails` (`--fail-on-forecast`) make Markdown
    and JUnit say failed where the exit code does."""
    from nandoctor.render.junit import render_junit
    from nandoctor.render.markdown import render_markdown
    from nandoctor.report.types import Report

    renderers: dict[str, Callable[[Report], str]] = {
        "--json": Report.to_json,
        "--markdown": lambda r: render_markdown(r, divergence_fails, forecast_fails),
        "--junit": lambda r: render_junit(r, divergence_fails, forecast_fails),
    }
    for option, path in outputs.items():
        if path:
            write_text(path, renderers[option](report), option)
