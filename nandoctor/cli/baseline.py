"""`nandoctor baseline CONFIG --out FILE`: record a healthy run's numeric health, for
`nandoctor diagnose CONFIG --baseline FILE` to gate on."""

from __future__ import annotations

from pathlib import Path

import typer

from nandoctor.cli import options
from nandoctor.cli.app import app, cli_console, handles_errors
from nandoctor.cli.diagnose import launch_ranks, run_with_progress
from nandoctor.cli.outcome import Outcome, of_baseline
from nandoctor.cli.output import write_text


@app.command()
@handles_errors
def baseline(
    config: Path = typer.Argument(..., help="The run's YAML config."),
    out: str = typer.Option(..., "--out", help="Where to write the baseline JSON."),
    steps: int | None = options.Steps,
    device: str | None = options.Device,
    dtype: str | None = options.Dtype,
    autocast_policy: str | None = options.AutocastPolicy,
    seed: int | None = options.Seed,
    time_budget: float | None = options.TimeBudget,
    quiet: bool = options.Quiet,
    debug: bool = options.Debug,
) -> Outcome:
    """Record a healthy run's numeric health; exit 1 (and write nothing) if it is not healthy."""
    # NB: imported here, so that --help stays free of torch
    from nandoctor.diagnose import engine
    from nandoctor.gate.baseline import baseline_of
    from nandoctor.render.terminal import render_report
    from nandoctor.setup import distributed
    from nandoctor.setup.load import load_config

    outputs = options.check_outputs({"--out": out})
    loaded = load_config(config).with_overrides(
        steps=steps, device=device, dtype=dtype, seed=seed, autocast_policy=autocast_policy
    )
    options.protect_inputs(outputs, loaded)
    out = outputs["--out"] or out
    nproc = loaded.config.distributed.nproc_per_node
    if nproc > 1 and not distributed.under_launcher():  # as diagnose: one job of N ranks
        return launch_ranks(loaded, nproc)
    quiet = quiet or distributed.current_rank() != 0  # rank 0 speaks for the job
    # NB: a baseline records the run's health; it does not judge it (no gate)
    settings = engine.DiagnoseOptions(
        verify=False, measure_health=True, gate=False, time_budget=time_budget
    )
    console = cli_console(stderr=out == "-")
    report = run_with_progress(console, "baseline", str(config), loaded, settings, quiet)
    if distributed.current_rank() != 0:  # rank 0 writes the baseline
        return Outcome()
    render_report(console, report, quiet=quiet, command="baseline", divergence_fails=True)
    outcome = of_baseline(report)
    if outcome.found or outcome.passthrough is not None:
        why = "was interrupted" if outcome.interrupted else "was not healthy"
        if report.healthy and not outcome.interrupted:
            why = "diverged (a baseline is a run that trained well)"
        console.print(f"[red]no baseline written: the run {why}[/]")
        return outcome
    write_text(
        out, baseline_of(report, loaded.config.seed, report.steps_completed).to_json(), "--out"
    )
    if not quiet or out != "-":  # NB: a CI log says where the file went, --quiet or not
        console.print(
            f"baseline of {report.steps_completed} steps written to {out}", soft_wrap=True
        )
    return outcome
