"""`nandoctor watch -- CMD...`: run a training command unchanged, with the sentinel on."""

from __future__ import annotations

from pathlib import Path

import typer

from nandoctor.cli import options
from nandoctor.cli.app import app, cli_console, handles_errors, stderr_console
from nandoctor.cli.diagnose import write_reports
from nandoctor.cli.outcome import Outcome, of_watch
from nandoctor.cli.output import check_not_input
from nandoctor.errors import UsageError
from nandoctor.watch.protocol import DEFAULT_REPLAY_BUDGET


@app.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@handles_errors
def watch(
    command: list[str] = typer.Argument(
        None, metavar="-- CMD...", help="The command to run, e.g. -- python train.py --lr 3e-4"
    ),
    json_path: str | None = options.Json,
    markdown_path: str | None = options.Markdown,
    junit_path: str | None = options.Junit,
    keep_going: bool = typer.Option(
        False, "--continue", help="Let the script go on after the first non-finite step."
    ),
    replay: bool = typer.Option(
        True,
        "--replay/--no-replay",
        help="Rerun the command up to the bad step to name its tensor, op and source line.",
    ),
    replay_budget: float = typer.Option(
        DEFAULT_REPLAY_BUDGET,
        "--replay-budget",
        min=0,
        callback=options.a_number,
        help="Replay only if the run failed within this many seconds.",
    ),
    quiet: bool = options.Quiet,
    debug: bool = options.Debug,
    tensorboard_dir: str | None = options.TensorBoard,
    fail_on_divergence: bool = options.FailOnDivergence,
    fail_on_forecast: bool = options.FailOnForecast,
) -> Outcome:
    """Run CMD with the sentinel attached; exit 1 at the first non-finite step, else CMD's
    own exit code."""
    import tempfile

    from nandoctor.watch import process  # NB: free of torch, as --help must stay
    from nandoctor.watch.protocol import Settings

    if not command:
        raise UsageError("watch: no command given", hint="nandoctor watch -- python train.py")
    if command[0].startswith("-"):  # NB: unknown options reach here as the command's
        raise UsageError(
            f"watch: no such option: {command[0]}",
            hint="options go before --, the command after it: nandoctor watch --json r.json "
            "-- python train.py",
        )
    outputs = {"--json": json_path, "--markdown": markdown_path, "--junit": junit_path}
    options.check_outputs(outputs)
    files = {f"command's file {a}": Path(a) for a in command if Path(a).is_file()}
    for option, path in outputs.items():
        check_not_input(path, option, files)
    tensorboard_dir = options.checked_logdir(tensorboard_dir, outputs)
    # NB: the command owns stdout; the report goes to stderr (JSON to stdout only with `-`)
    console = cli_console(stderr=True)

    def on_replay(step: int) -> None:
        if not quiet:
            stderr_console().print(
                f"[dim]nandoctor watch: step {step} went non-finite; rerunning the command "
                "up to it to replay it under the tracer[/]"
            )

    to_stderr = options.report_console_to_stderr(*outputs.values())
    with tempfile.TemporaryDirectory(prefix="nandoctor-watch-") as folder:
        # NB: the command starts at once; what reads its results (torch among it) is
        # imported beside it, not before it
        with process.importing(*_REPORT_MODULES):
            settings = Settings(folder, keep_going=keep_going)
            code = process.run_command(list(command), settings, stdout_to_stderr=to_stderr)
        from nandoctor.render import tensorboard
        from nandoctor.render.terminal import render_report
        from nandoctor.watch import runner

        opts = runner.WatchOptions(replay, replay_budget, to_stderr, kept_going=keep_going)
        watched = runner.watched(list(command), folder, code, opts, on_replay=on_replay)
    render_report(
        console,
        watched.report,
        quiet=quiet,
        divergence_fails=fail_on_divergence,
        forecast_fails=fail_on_forecast,
    )
    if tensorboard_dir:
        tensorboard.write_report(watched.report, tensorboard_dir)
    write_reports(watched.report, outputs, fail_on_divergence, fail_on_forecast)
    return of_watch(watched.report, watched.command_code, fail_on_divergence, fail_on_forecast)


# NB: what `watch` needs once the command has run, imported while it runs
_REPORT_MODULES = (
    "nandoctor.watch.runner",
    "nandoctor.render.terminal",
    "nandoctor.render.tensorboard",
)
