"""Baseline files: a healthy run's numeric health, versioned JSON with sorted keys, so a
baseline diffs well in code review.

    {"format": "nandoctor-baseline", "schema_version": 1, "config": "...", "dtype": "float16",
     "autocast_policy": "cuda", "health": {"final_loss": 0.41, "grad_norm": {"p50": ...},
     "modules": [...]}, ...}

A baseline gates only runs of its own numerics (`require_comparable`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from nandoctor.errors import UsageError
from nandoctor.report.health import Health
from nandoctor.report.types import Environment, Report, jsonable
from nandoctor.setup.load import FileTooLarge, read_at_most

FORMAT = "nandoctor-baseline"
BASELINE_VERSION = 1


@dataclass
class Baseline:
    config: str
    name: str | None
    dtype: str
    device: str
    torch: str
    seed: int
    steps: int
    health: Health
    autocast_policy: str | None = None  # None: recorded before baselines kept it
    grad_scaler: bool | None = None  # None: recorded before baselines kept it
    format: str = FORMAT
    schema_version: int = BASELINE_VERSION

    def to_json(self) -> str:
        return (
            json.dumps(
                jsonable(dataclasses.asdict(self)), indent=2, sort_keys=True, allow_nan=False
            )
            + "\n"
        )


def baseline_of(report: Report, seed: int, steps: int) -> Baseline:
    assert report.health is not None
    env = report.environment
    return Baseline(
        report.config,
        report.name,
        env.dtype,
        env.device,
        env.torch,
        seed,
        steps,
        report.health,
        env.autocast_policy,
        env.grad_scaler,
    )


def require_comparable(baseline: Baseline, path: str, run: Environment) -> None:
    """Refuse, before the run, a baseline recorded under other numerics: the gate measures
    headroom, the distance to the dtype's largest value (float16's 65504 is not
    bfloat16's 3.4e38), and the half-precision ops of CUDA's autocast lists are not the
    CPU's own (softmax, log, norms stay in float16 there). Peaks from another dtype or
    other lists would pass or fail the run for a difference no change of the user made."""
    dtype = run.dtype
    if baseline.dtype != dtype:
        raise UsageError(
            f"--baseline {path}: recorded in {baseline.dtype}, this run trains in {dtype}; "
            f"record the baseline in {dtype} (nandoctor baseline CONFIG --dtype {dtype})"
        )
    recorded = _cast_lists(baseline.device, dtype, baseline.autocast_policy)
    running = _cast_lists(run.device, dtype, run.autocast_policy)
    if recorded is not None and running is not None and recorded != running:
        raise UsageError(
            f"--baseline {path}: recorded with {_LISTS[recorded]}, this run autocasts with "
            f"{_LISTS[running]}: their {dtype} ops differ; record the baseline as this run "
            "runs (same device and --autocast-policy)"
        )
    if baseline.grad_scaler is not None and baseline.grad_scaler != run.grad_scaler:
        # NB: with a scaler the recorded gradients carry its scale (65536 at the start):
        # a run without one compared its true gradients with those, and passed any growth
        had, has = ("a GradScaler", "none") if baseline.grad_scaler else ("none", "a GradScaler")
        raise UsageError(
            f"--baseline {path}: recorded with {had}, this run has {has}: its gradients' "
            "peaks are not comparable; record the baseline as this run runs "
            "(precision.grad_scaler)"
        )


def require_same_model(baseline: Baseline, path: str, modules: dict[str, str]) -> None:
    """Refuse, before the run, a baseline recorded from another model: the gate compares
    peaks module by module, so a baseline that shares no module (by name and type) with
    this run's model compared nothing and passed every run. `modules`: this run's
    model, name to type. A model that grew or lost layers shares the rest: gated, its new
    modules judged "not measured in the baseline". NB: at least half of the baseline's
    modules must be this run's: a Conv1d network shares a `2 Linear` with an MLP by
    chance, and a gate of that one layer passed the whole other model."""
    recorded = {(m.module, m.type) for m in baseline.health.modules if m.module}
    shared = recorded & {(n, t) for n, t in modules.items() if n}
    if not recorded or 2 * len(shared) >= len(recorded):
        return
    which = "none" if not shared else f"only {len(shared)}"
    raise UsageError(
        f"--baseline {path}: recorded from another model ({baseline.config}): {which} of "
        f"its {len(recorded)} modules {'is' if not shared else 'are'} in this run's (not "
        f"in this run: {_some(recorded - shared)}; this run's: {_some(modules.items())}); "
        "record the baseline from this model (nandoctor baseline CONFIG --out PATH)"
    )


def _some(modules: Iterable[tuple[str, str]]) -> str:
    named = sorted((n, t) for n, t in modules if n)
    listed = ", ".join(f"{n} {t}" for n, t in named[:3])
    return listed + (", ..." if len(named) > 3 else "")


_LISTS = {"cuda": "CUDA's autocast lists", "cpu": "the CPU's own autocast lists"}


def _cast_lists(device: str, dtype: str, policy: str | None) -> str | None:
    """Whose autocast lists a run's half-precision ops follow: `cuda` (a CUDA device, or
    the CPU emulating CUDA's), `cpu` (the CPU's own); None where nothing is autocast
    (float32) or a baseline did not record its policy."""
    if dtype == "float32":
        return None
    if device.startswith("cuda") or policy == "cuda":
        return "cuda"
    return "cpu" if policy == "native" else None


# a baseline holds a few numbers per module: tens of thousands of modules fit many times
MAX_BASELINE_BYTES = 64 << 20


def read_baseline(path: str) -> Baseline:
    if not path:  # NB: `--baseline "$UNSET"` would otherwise gate on nothing, and pass
        raise UsageError("--baseline: expected a baseline file, got an empty string")
    try:
        data = json.loads(read_at_most(Path(path), MAX_BASELINE_BYTES))
    except FileNotFoundError:
        raise UsageError(f"--baseline {path}: file not found") from None
    except FileTooLarge as e:
        raise UsageError(f"--baseline {path}: not a baseline: {e}") from None
    except (OSError, ValueError) as e:
        raise UsageError(f"--baseline {path}: not a readable JSON file: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(
            f"--baseline {path}: not a nandoctor baseline (record one with `nandoctor baseline`)"
        )
    if data.get("schema_version") != BASELINE_VERSION:
        found = data.get("schema_version")
        raise UsageError(
            f"--baseline {path}: baseline version {found}, expected {BASELINE_VERSION}"
        )
    try:
        return TypeAdapter(Baseline).validate_python(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(k) for k in first["loc"]) or "the file"
        raise UsageError(
            f"--baseline {path}: malformed baseline: {where}: {first['msg']}"
        ) from None
