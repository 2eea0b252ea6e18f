"""`nandoctor diagnose`: build the session, run it under the sentinel, write the report.

The engine knows nothing of terminals: the CLI passes callbacks to show progress, and
gets a `Report` back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nandoctor import __version__
from nandoctor.configfile import LoadedConfig
from nandoctor.devices import CPU_AUTOCAST_NOTE
from nandoctor.replay import RunResult, StepCallback, fast_run
from nandoctor.report import Environment, FirstNonfinite, Report, Tool
from nandoctor.session import Session, build_session

SessionCallback = Callable[[Session], None]


def diagnose(
    loaded: LoadedConfig,
    *,
    on_session: SessionCallback | None = None,
    on_step: StepCallback | None = None,
) -> Report:
    session = build_session(loaded)
    if on_session is not None:
        on_session(session)
    result = fast_run(session, loaded.config.steps, on_step=on_step)
    return build_report("diagnose", loaded, session, result)


def build_report(command: str, loaded: LoadedConfig, session: Session, result: RunResult) -> Report:
    failure = result.failure
    first = None
    if failure is not None and failure.step is not None and failure.phase is not None:
        first = FirstNonfinite(step=failure.step, phase=failure.phase.value)
    return Report(
        command=command,
        config=str(loaded.path),
        name=loaded.config.name,
        environment=environment_of(session),
        status=result.status,
        steps_completed=result.steps_completed,
        summary=summarize(result),
        first_nonfinite=first,
        events=result.events,
        telemetry=result.telemetry,
        notes=session_notes(session),
        tool=Tool(version=__version__),
    )


def environment_of(session: Session) -> Environment:
    return Environment(
        device=str(session.device),
        torch=torch.__version__,
        dtype=str(session.dtype).removeprefix("torch."),
        grad_scaler=session.scaler is not None,
        threads=torch.get_num_threads(),
    )


def session_notes(session: Session) -> list[str]:
    notes = []
    if session.config.device == "auto" and session.device.type == "cpu":
        notes.append("device auto: no CUDA device found, so the run replayed on the CPU")
    if session.device.type == "cpu" and session.dtype != torch.float32:
        notes.append(CPU_AUTOCAST_NOTE)
    return notes


def summarize(result: RunResult) -> str:
    if result.status == "interrupted":
        return f"interrupted after {result.steps_run} steps; no non-finite value seen before"
    if result.failure is None:
        return f"all {result.steps_run} steps stayed finite"
    f = result.failure
    return f"step {f.step}, phase {f.phase.value if f.phase else '?'}: {f.why}"
