"""Baseline files: a healthy run's numeric health, versioned JSON with sorted keys, so a
baseline diffs well in code review.

    {"format": "nandoctor-baseline", "schema_version": 1, "config": "...", "dtype": "float16",
     "health": {"final_loss": 0.41, "grad_norm": {"p50": ...}, "modules": [...]}, ...}
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from nandoctor.errors import UsageError
from nandoctor.report.health import Health
from nandoctor.report.types import Report, jsonable

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
        report.config, report.name, env.dtype, env.device, env.torch, seed, steps, report.health
    )


def read_baseline(path: str) -> Baseline:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"--baseline {path}: file not found") from None
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
        raise UsageError(
            f"--baseline {path}: malformed baseline: {str(e).splitlines()[0]}"
        ) from None
