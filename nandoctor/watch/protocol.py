"""How `nandoctor watch` talks to the processes it starts: one environment variable in,
files in a private folder out. Standard library only: the bootstrap reads this before
torch is imported.

    NANDOCTOR_WATCH='{"dir": "/tmp/nandoctor-watch-x1y2", "keep_going": false,
                      "trace_step": null, "loss_scale": null}'

Each watched process writes, into `dir`, `attached-<pid>` when it attaches (torch was
imported), `run-<pid>.json` with what its sentinel saw, `raised-<pid>` when it dies of
an uncaught exception (torch imported or not), and on a replay run `trace-<pid>.json`
with what the tracer found at `trace_step` (on a recheck run, `recheck-<pid>.json`: the
skips rechecked at loss scale 1); both JSON files say the process's place in a
job of several ranks (`job_place`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

ENV = "NANDOCTOR_WATCH"
DEFAULT_REPLAY_BUDGET = 600.0  # seconds to the failure, beyond which no rerun is made


@dataclass(frozen=True)
class Settings:
    dir: str
    keep_going: bool = False  # --continue: record the first bad step, let the script go on
    trace_step: int | None = None  # a replay run: trace this step, then stop
    loss_scale: float | None = None  # the replayed step's GradScaler scale (a collapse)
    recheck_steps: list[int] | None = None  # a recheck run: these skips, at loss scale 1

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ) -> Settings | None:
        text = environ.get(ENV)
        return cls(**json.loads(text)) if text else None


def job_place(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, int | None]:
    """This process's rank in a job of several (torchrun's `RANK` and `WORLD_SIZE`, which
    every launcher of PyTorch jobs sets), written beside what it saw: None for both in a
    process of its own."""
    try:
        rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return {"rank": None, "world_size": None}
    if world < 2 or not 0 <= rank < world:
        return {"rank": None, "world_size": None}
    return {"rank": rank, "world_size": world}


def attached_marker(folder: str, pid: int) -> Path:
    return Path(folder) / f"attached-{pid}"


def stopped_marker(folder: str, pid: int) -> Path:
    """Written by a process the sentinel stopped: the command should end soon after."""
    return Path(folder) / f"stopped-{pid}"


def raised_marker(folder: str, pid: int) -> Path:
    """Written by a process that died of an uncaught exception: its type and message."""
    return Path(folder) / f"raised-{pid}"


def run_file(folder: str, pid: int) -> Path:
    return Path(folder) / f"run-{pid}.json"


def recheck_file(folder: str, pid: int) -> Path:
    """A recheck run's answers: each rechecked skip's step, and whether its gradients were
    non-finite at loss scale 1 (`watch/recheck.py`)."""
    return Path(folder) / f"recheck-{pid}.json"


def trace_file(folder: str, pid: int) -> Path:
    return Path(folder) / f"trace-{pid}.json"


def write_json(path: Path, data: dict) -> None:
    """Atomically: the parent reads a whole file or none (a process may die mid-write)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)
