"""`nandoctor compare`: the same run under several dtypes, side by side.

Each run is built from the same config and seed, so it starts from the same weights (or
the same checkpoint) and sees the same batches in the same order (the data stream has its
own RNG; see data.py); only the autocast dtype, and with it the GradScaler's default,
changes. Every run goes through the same loop and sentinel as `diagnose`, plus a headroom
probe that records how close each module came to float16's limit.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from nandoctor.compare.verdict import compare_verdict
from nandoctor.report.comparison import CompareEnvironment, CompareRun, Comparison
from nandoctor.report.types import Tool
from nandoctor.runtime.fast_run import RunResult, StepCallback, fast_run, snapshot_store
from nandoctor.runtime.headroom import HeadroomProbe, went_nonfinite_in
from nandoctor.runtime.probe import Phase
from nandoctor.runtime.record import RunStatus
from nandoctor.setup import distributed
from nandoctor.setup.devices import check_dtype_supported, cpu_autocast_note, resolve_device
from nandoctor.setup.dtypes import canonical_dtype, torch_dtype
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import Session, build_session
from nandoctor.version import __version__

REFERENCE = "float32"
TOP_MODULES = 5
RunCallback = Callable[[str, Session], None]


def compare(
    loaded: LoadedConfig,
    dtypes: list[str],
    *,
    on_run: RunCallback | None = None,
    on_step: StepCallback | None = None,
) -> Comparison:
    names = _dtypes_to_run(loaded, dtypes)
    device = resolve_device(loaded.config.device)
    for name in names:  # refuse an unsupported dtype before any run starts
        check_dtype_supported(device, torch_dtype(name))
    runs: list[CompareRun] = []
    ended: RunResult | None = None  # a run the user's code ended (sys.exit, an exception)
    for i, name in enumerate(names):
        if any(r.dtype == name for r in runs):  # the config's own run computed in it
            continue
        run, result = _one_run(loaded if i == 0 else _in_dtype(loaded, name), on_run, on_step)
        runs.append(run)
        if result.status is RunStatus.ERROR:
            ended = result
        if result.status in (RunStatus.INTERRUPTED, RunStatus.ERROR):
            break
    distributed.leave()  # a data-parallel job (under torchrun): every rank is done
    reference = REFERENCE if any(r.dtype == REFERENCE for r in runs) else None
    if reference is not None:
        _fill_drift(runs, next(r for r in runs if r.dtype == reference))
    policy = loaded.config.precision.autocast_policy
    notes = [cpu_autocast_note()] if device.type == "cpu" and policy == "native" else []
    threads = torch.get_num_threads()
    verdict = compare_verdict(runs, runs[0].dtype, loaded.config.steps)
    if ended is not None:
        verdict = f"the {runs[-1].dtype} run: {ended.ended_by}; no verdict"
    comparison = Comparison(
        config=str(loaded.path),
        environment=CompareEnvironment(str(device), torch.__version__, threads, policy),
        runs=runs,
        verdict=verdict,
        reference=reference,
        name=loaded.config.name,
        notes=notes,
        tool=Tool(version=__version__),
    )
    if ended is not None and ended.raised is not None:  # NB: its comparison rides with it
        ended.raised.report = comparison
        raise ended.raised
    return comparison


def _dtypes_to_run(loaded: LoadedConfig, dtypes: list[str]) -> list[str]:
    """The config's own dtype first, then each asked for, once each (NB: one the config's
    run computed in is not run again: FSDP's `param_dtype` may make it another than the
    config's `precision.dtype`, so the runs skip it as they meet it)."""
    asked = dict.fromkeys(canonical_dtype(d) for d in dtypes)
    return [loaded.config.precision.dtype, *asked]


def _in_dtype(loaded: LoadedConfig, name: str) -> LoadedConfig:
    """The config computing in `name`: autocast's dtype, and no FSDP `param_dtype` (which
    would cast a float32 run to it: the config's own run keeps it, and says so in its
    label, the dtype it computed in)."""
    changed = loaded.with_overrides(dtype=name)
    distributed = changed.config.distributed
    mixed = distributed.mixed_precision
    if mixed is None or mixed.param_dtype is None:
        return changed
    mixed = mixed.model_copy(update={"param_dtype": None})
    distributed = distributed.model_copy(update={"mixed_precision": mixed})
    return LoadedConfig(
        changed.config.model_copy(update={"distributed": distributed}), changed.path, changed.lines
    )


def _one_run(loaded: LoadedConfig, on_run, on_step) -> tuple[CompareRun, RunResult]:
    session = build_session(loaded)
    name = str(session.compute_dtype).removeprefix("torch.")  # NB: FSDP may cast a float32 run
    if on_run is not None:
        on_run(name, session)
    headroom = HeadroomProbe(session.model, session.compute_dtype)
    # NB: the snapshots let each GradScaler skip be rechecked at loss scale 1, as diagnose
    # does: a NaN the scaler hides is this dtype's failure, not a healthy run
    result = fast_run(
        session,
        loaded.config.steps,
        on_step=on_step,
        probe=headroom,
        store=snapshot_store(session),
        thorough=True,
        user_exit_ends_run=True,  # NB: the comparison so far is still written (exit 3)
    )
    return _summary(name, session, result, headroom), result


def _summary(name: str, session: Session, result: RunResult, headroom: HeadroomProbe) -> CompareRun:
    failure = result.failure
    finite = [v for v in result.telemetry.loss if v == v and abs(v) != float("inf")]
    times = result.step_seconds[1:] or result.step_seconds  # the first step warms up
    peaks = headroom.peaks()
    broke = None
    if failure is not None and failure.phase is Phase.FORWARD and failure.step is not None:
        broke = went_nonfinite_in(peaks, failure.step)
    return CompareRun(
        dtype=name,
        grad_scaler=session.scaler is not None,
        status=result.status.value,
        steps_completed=result.steps_completed,
        first_nonfinite_step=failure.step if failure else None,
        first_nonfinite_phase=failure.phase.value if failure and failure.phase else None,
        final_loss=finite[-1] if finite else None,
        max_abs_loss_diff_vs_reference=None,
        step_time_ms=round(statistics.median(times) * 1000, 3) if times else None,
        headroom=peaks[:TOP_MODULES],
        telemetry=result.telemetry,
        nonfinite_module=broke.module if broke is not None else None,
    )


def _fill_drift(runs: list[CompareRun], reference: CompareRun) -> None:
    """Largest |loss - reference loss| over the steps where both are finite."""
    ref = dict(zip(reference.telemetry.step, reference.telemetry.loss, strict=True))
    for run in runs:
        diffs = [
            abs(loss - ref[step])
            for step, loss in zip(run.telemetry.step, run.telemetry.loss, strict=True)
            if step in ref and _finite(loss) and _finite(ref[step])
        ]
        run.max_abs_loss_diff_vs_reference = max(diffs) if diffs else None


def _finite(x: float | None) -> bool:
    return x is not None and x == x and abs(x) != float("inf")
