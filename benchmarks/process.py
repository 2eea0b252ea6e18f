"""Whole processes, as a user times them: `nandoctor diagnose CONFIG --steps N` beside a
plain script of the same loop (benchmarks/plain_loop.py), start-up included, each with
its system time and peak memory (its own rusage, from `os.wait4` in a small launcher:
`LAUNCHER`).

The processes of a figure run in pairs, the order alternating (plain first, then
diagnose first: the machine's load drifts over minutes), and every ratio is taken within
a pair; a figure is the median of its pairs'. Every process of pair i runs under
PYTHONHASHSEED=i: the same plain script took 1,700 to 7,300 page faults a step under
different seeds alone (where glibc's heap blocks happen to lie decides whether freed
memory goes back to the kernel every step), so a pair's two sides share their luck.

Beside the plain loop, the same script runs with glibc's malloc set as `diagnose` sets it
in its own process (`nandoctor.runtime.host_memory`): its steps keep the memory they
free. `diagnose` over that loop is nandoctor's own cost; over the plain loop, what the
user sees.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.candidates import plain_step
from benchmarks.measure import Spread
from benchmarks.plain_loop import spec_of
from benchmarks.workloads import Workload
from nandoctor.runtime.host_memory import GLIBC_ENV
from nandoctor.runtime.snapshot import state_bytes
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import build_session

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("plain", "plain+malloc", "diagnose")  # see the module's docstring
Say = Callable[[str], None]


@dataclass
class Usage:
    """One process, launch to exit."""

    wall_s: float
    user_s: float
    sys_s: float
    peak_mib: float  # its largest resident set
    faults: int  # minor page faults: memory mapped afresh
    ended: dict[str, Any] = field(default_factory=dict)  # the plain loop's JSON, or
    # diagnose's report (its status, steps, timing)


@dataclass
class ProcessTimes:
    """A workload's step loop, N steps, whole process beside whole process."""

    workload: str
    size: str
    steps: int
    step_ms: float  # the plain loop's step, its loop alone: the median over its runs
    state_mib: float  # weights, buffers and optimizer state: what a snapshot copies
    usage: dict[str, list[Usage]]  # per arm, pair by pair
    ratio: dict[str, Spread]  # per quantity: diagnose / plain, pair by pair (`_ratios`)


def steps_for(workload: Workload, size: str, device: str, seconds: float) -> int:
    """Steps that take the plain loop about `seconds` here (timed on three steps, after
    two to warm up), 20 at least."""
    session = build_session(workload.config(size, 5, device))
    batches = [b for _, b in itertools.islice(session.batches, 5)]
    for batch in batches[:2]:
        plain_step(session, batch)
    start = time.perf_counter()
    for batch in batches[2:]:
        plain_step(session, batch)
    step_s = (time.perf_counter() - start) / 3
    return max(20, round(seconds / step_s))


def _state_mib(loaded: LoadedConfig) -> float:
    """The training state's size once the optimizer has its state (after a step)."""
    session = build_session(loaded)
    plain_step(session, next(iter(session.batches))[1])
    return state_bytes(session) / 2**20


def process_times(
    workload: Workload, size: str, steps: int, pairs: int, device: str = "cpu", say: Say = print
) -> ProcessTimes:
    """`pairs` rounds of the three arms, the order reversed every other round."""
    loaded = workload.config(size, steps, device)
    usage: dict[str, list[Usage]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        files = _Files(Path(tmp), loaded, stop_at_nonfinite=False)
        for i in range(pairs):
            for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
                usage[arm].append(files.run(arm, seed=i, expect={0}))
            say(f"  {workload.name} pair {i + 1}/{pairs}: " + _pair_line(usage, i))
    loop_ms = statistics.median(u.ended["loop_s"] / steps * 1000 for u in usage["plain"])
    state = _state_mib(loaded)
    return ProcessTimes(workload.name, size, steps, loop_ms, state, usage, _ratios(usage))


def _ratios(usage: dict[str, list[Usage]]) -> dict[str, Spread]:
    """diagnose over the plain loop: wall, the loop alone, user + system (cpu), system
    time and peak memory; `own`: wall time over the plain loop with diagnose's malloc
    settings."""

    def ratio(value: Callable[[Usage], float], over: str = "plain") -> Spread:
        pairs = zip(usage["diagnose"], usage[over], strict=True)
        return Spread.of([value(d) / max(value(p), 1e-9) for d, p in pairs])

    loops = zip(usage["diagnose"], usage["plain"], strict=True)
    return {
        "wall": ratio(lambda u: u.wall_s),
        # the loop alone, start-up and exit aside: diagnose's run_s over the plain loop's
        "loop": Spread.of([d.ended["timing"]["run_s"] / p.ended["loop_s"] for d, p in loops]),
        "cpu": ratio(lambda u: u.user_s + u.sys_s),
        "sys": ratio(lambda u: u.sys_s),
        "peak": ratio(lambda u: u.peak_mib),
        "own": ratio(lambda u: u.wall_s, over="plain+malloc"),
    }


def _pair_line(usage: dict[str, list[Usage]], i: int) -> str:
    cells = [f"{arm} {usage[arm][i].wall_s:.1f} s (sys {usage[arm][i].sys_s:.1f})" for arm in ARMS]
    ratio = usage["diagnose"][i].wall_s / usage["plain"][i].wall_s
    return ", ".join(cells) + f": {ratio:.2f}x"


# -- time to a verified diagnosis ------------------------------------------------------
# NB: a learning rate that jumps 300-fold at the milestone (SGD with momentum): the MLP's
# weights then blow up within a few dozen steps, and diagnose has a failure to locate,
# causes to rank and fixes to replay, as in a job whose schedule went wrong
VERIFIED_OPTIMIZER = {"name": "SGD", "lr": 0.01, "momentum": 0.9}
VERIFIED_GAMMA = 300.0


@dataclass
class VerifiedProcess:
    """`nandoctor diagnose CONFIG` (every applicable fix replayed, the default budget)
    beside the plain loop stopping at its first non-finite loss."""

    workload: str
    milestone: int  # the step the learning rate jumps at
    plain: list[Usage]  # pair by pair
    diagnose: list[Usage]
    ratios: list[float]  # diagnose's wall time over the plain loop's, pair by pair
    plain_failed_at: int | None  # the step the plain loop stopped at
    found: str  # what diagnose reported
    timing: dict[str, float]  # its report's: run_s, replay_s, verify_s
    verdicts: list[str]  # per cause: id, and what its replay showed

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


def verified_process(
    workload: Workload,
    size: str,
    milestone: int,
    pairs: int,
    device: str = "cpu",
    say: Say = print,
) -> VerifiedProcess:
    scheduler = {"name": "MultiStepLR", "milestones": [milestone], "gamma": VERIFIED_GAMMA}
    steps = milestone + max(100, milestone // 4)  # room past the failure
    loaded = workload.config(size, steps, device, optimizer=VERIFIED_OPTIMIZER, scheduler=scheduler)
    runs: dict[str, list[Usage]] = {"plain": [], "diagnose": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = _Files(Path(tmp), loaded, stop_at_nonfinite=True)
        for i in range(pairs):
            for arm in ("plain", "diagnose") if i % 2 == 0 else ("diagnose", "plain"):
                runs[arm].append(files.run(arm, seed=i, expect={0, 1}, steps=None))
            plain, ours = runs["plain"][i], runs["diagnose"][i]
            say(
                f"  verified diagnosis pair {i + 1}/{pairs}: plain {plain.wall_s:.1f} s, "
                f"diagnose {ours.wall_s:.1f} s: {ours.wall_s / plain.wall_s:.2f}x"
            )
    report = runs["diagnose"][0].ended
    return VerifiedProcess(
        workload.name,
        milestone,
        runs["plain"],
        runs["diagnose"],
        [d.wall_s / p.wall_s for d, p in zip(runs["diagnose"], runs["plain"], strict=True)],
        runs["plain"][0].ended.get("nonfinite_at"),
        _found(report),
        report.get("timing") or {},
        [f"{c['id']}: {c.get('verification') or 'not verified'}" for c in report["causes"]],
    )


def _found(report: dict[str, Any]) -> str:
    first = report.get("first_nonfinite")
    if not first:
        return report["status"]
    return f"step {first['step']}, phase {first['phase']}, {first['tensor']}"


class _Files:
    """A workload's config and the plain loop's SPEC, written once; `run` launches an arm."""

    def __init__(self, tmp: Path, loaded: LoadedConfig, stop_at_nonfinite: bool) -> None:
        self.tmp, self.config = tmp, tmp / "config.yaml"
        self.steps = loaded.config.steps
        self.config.write_text(
            yaml.safe_dump(loaded.config.model_dump(mode="json", exclude_unset=True))
        )
        self.spec = tmp / "plain.json"
        spec = spec_of(loaded.config, stop_at_nonfinite=stop_at_nonfinite)
        self.spec.write_text(json.dumps(spec))

    def run(self, arm: str, seed: int, expect: set[int], steps: int | None = -1) -> Usage:
        """Launch one arm; `steps` passes `--steps` to diagnose (-1: the config's steps
        again, None: none, the config decides); its exit code must be in `expect`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env.pop("GLIBC_TUNABLES", None)
        env.update(PYTHONPATH=str(ROOT), PYTHONHASHSEED=str(seed))
        if arm == "diagnose":
            report = self.tmp / "report.json"
            argv = [sys.executable, "-m", "nandoctor", "diagnose", str(self.config)]
            argv += ["--json", str(report)]
            argv += ["--steps", str(self.steps if steps == -1 else steps)] if steps else []
        else:
            argv = [sys.executable, "-m", "benchmarks.plain_loop", str(self.spec)]
            env.update(GLIBC_ENV if arm == "plain+malloc" else {})
        usage, code, output = launch(argv, env, self.tmp / f"{arm}.log")
        if code not in expect:
            raise RuntimeError(f"{' '.join(argv)}: exit {code}\n{output[-2000:]}")
        if arm == "diagnose":
            usage.ended = json.loads(report.read_text())
        else:
            usage.ended = json.loads(output.strip().splitlines()[-1])
        return usage


# NB: the launch itself runs in a fresh, small process: a child's peak memory (ru_maxrss)
# counts its parent's resident set at the moment it was spawned (Linux accounts the memory
# the exec replaced to the new program), and the benchmark's own holds torch and models
LAUNCHER = """
import json, os, subprocess, sys, time
log, argv = sys.argv[1], sys.argv[2:]
with open(log, "w") as out:
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
print(json.dumps({
    "code": os.waitstatus_to_exitcode(status), "wall_s": wall, "user_s": usage.ru_utime,
    "sys_s": usage.ru_stime, "peak_mib": usage.ru_maxrss / 1024, "faults": usage.ru_minflt,
}))
"""


def launch(argv: list[str], env: dict[str, str], log: Path) -> tuple[Usage, int, str]:
    """Run `argv` to its end: its usage (its own, not its siblings': `os.wait4`, in
    `LAUNCHER`), exit code and output."""
    done = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(log), *argv],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(done.stdout)
    code = got.pop("code")
    return Usage(**got), code, log.read_text()
