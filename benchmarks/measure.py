"""The figures, each measured in one process with the candidates interleaved: the machine
is noisy, so every figure is a median over rounds with its spread, and every ratio is
taken within a round (candidate / plain, side by side)."""

from __future__ import annotations

import itertools
import math
import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.candidates import Candidate, available, plain_step
from benchmarks.workloads import Workload
from nandoctor.diagnose.engine import DiagnoseOptions, diagnose
from nandoctor.localize.tracer import Tracer
from nandoctor.report.types import Report
from nandoctor.runtime.snapshot import AUTO_MAX_EVERY, SnapshotStore, state_bytes
from nandoctor.runtime.step import run_step
from nandoctor.setup.load import LoadedConfig
from nandoctor.setup.session import build_session


@dataclass
class Spread:
    """A median with its range, and the median's 95% confidence interval (`ci_low`,
    `ci_high`): on this noisy machine a median a little over its target may be noise,
    and one whose interval lies wholly above it is not."""

    median: float
    low: float
    high: float
    ci_low: float
    ci_high: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        ci_low, ci_high = median_interval(values)
        return cls(statistics.median(values), min(values), max(values), ci_low, ci_high)


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A confidence interval of the median that assumes nothing of the distribution:
    the j-th smallest and j-th largest values, with j the largest rank such that fewer
    than j of n values fall below the true median with probability at most
    (1 - level) / 2 (that count is binomial(n, 1/2)). Too few values for any narrower
    interval: the range."""
    xs = sorted(values)
    n, tail, below, j = len(xs), (1 - level) / 2, 0.0, 0
    while j < n // 2:
        p = math.comb(n, j) / 2**n  # P(exactly j values fall below the median)
        if below + p > tail:
            break
        below, j = below + p, j + 1
    return (xs[0], xs[-1]) if j == 0 else (xs[j - 1], xs[n - j])


# NB: the seconds of stepping one workload's candidates may take, at most
STEP_BUDGET_S = 20.0


@dataclass
class StepTimes:
    workload: str
    rounds: int = 0  # what was measured: rounds of `steps` turns (see `step_times`)
    steps: int = 0
    ms: dict[str, Spread] = field(default_factory=dict)  # per-step time of each candidate
    ratio: dict[str, Spread] = field(default_factory=dict)  # candidate / plain, per round


def step_times(
    workload: Workload,
    size: str,
    device: str,
    rounds: int,
    steps: int,
    budget_s: float = STEP_BUDGET_S,
    only: tuple[str, ...] | None = None,
) -> StepTimes:
    """Every candidate steps ONE session, in turn, a step each: a round is `steps` such
    turns, each in an order of its own (shuffled, seeded), and a candidate's ratio in a
    round is its time over the plain loop's.

    NB: one session, not a copy each. Two copies of the same run, both stepped by the
    plain loop, differ by up to 7% on a 2-core machine (where their memory lies), more
    than the overheads measured here; one session shared by all leaves only the
    candidates' own work to differ (`only`: only these candidates, the plain loop among
    them). NB: shuffled, not rotated: a rotation keeps each
    candidate behind the same one, and whoever follows a candidate with a session of its
    own (`transformers`) starts its step with that copy in the caches (rotated, the plain
    loop always followed it, and every ratio read up to 10% low on the MLP). Rounds and
    steps shrink to fit `budget_s` where a step takes seconds (bfloat16 matmuls emulated
    on a CPU without AVX512-BF16)."""
    loaded = workload.config(size, steps, device)
    shared = build_session(loaded)
    cands = {
        name: make(shared if make.shares_session else build_session(loaded))
        for name, make in available().items()
        if only is None or name in only
    }
    batches = [b for _, b in itertools.islice(shared.batches, max(steps, 2))]
    warm = {name: _run(cand, batches[:2]) / 2 for name, cand in cands.items()}  # allocators
    rounds, steps = _fit(rounds, steps, sum(warm.values()), budget_s)
    names = list(cands)
    order = random.Random(0)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        total = dict.fromkeys(names, 0.0)
        for i in range(steps):
            for name in order.sample(names, len(names)):
                total[name] += _run(cands[name], [batches[i % len(batches)]], first=r * steps + i)
        for name in names:
            per_round[name].append(total[name] / steps)
    for cand in cands.values():
        cand.close()
    out = StepTimes(workload.name, rounds=rounds, steps=steps)
    for name, times in per_round.items():
        out.ms[name] = Spread.of([t * 1000 for t in times])
        out.ratio[name] = Spread.of([t / p for t, p in zip(times, per_round["plain"], strict=True)])
    return out


def _fit(rounds: int, steps: int, turn_s: float, budget_s: float) -> tuple[int, int]:
    """The most rounds and steps (at least 3 and 2) whose turns fit `budget_s`."""
    while rounds * steps * turn_s > budget_s and (steps > 2 or rounds > 3):
        if steps > 2:
            steps -= 1
        else:
            rounds -= 1
    return rounds, steps


def _run(cand: Candidate, batches: list[Any], first: int = 0) -> float:
    _sync(cand.session.device)
    with cand.attached():  # NB: outside the timing: global hooks go on and off
        start = time.perf_counter()
        for i, batch in enumerate(batches):
            cand.step(first + i, batch)
        _sync(cand.session.device)
        elapsed = time.perf_counter() - start
    return elapsed


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- host reads ----------------------------------------------------------------------
_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")


@contextmanager
def counting_host_reads() -> Iterator[dict[str, int]]:
    """Count the calls that read a tensor's value on the host (a sync point on CUDA)."""
    counts = {"reads": 0}
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(original):
        def wrapper(self, *args, **kwargs):
            counts["reads"] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def host_reads(workload: Workload, size: str, device: str, steps: int = 5) -> dict[str, float]:
    out = {}
    loaded = workload.config(size, steps + 2, device)
    for name, make in available().items():
        cand = make(build_session(loaded))
        batches = [b for _, b in itertools.islice(cand.session.batches, steps + 2)]
        _run(cand, batches[:2])
        with counting_host_reads() as counts:
            _run(cand, batches[2:])
        cand.close()
        out[name] = counts["reads"] / steps
    if device.startswith("cuda"):
        out.update(_cuda_syncs(workload, size, steps))
    return out


def _cuda_syncs(workload: Workload, size: str, steps: int) -> dict[str, float]:
    """Blocking device synchronisations per step, as torch's sync debug mode counts them."""
    import warnings

    out = {}
    loaded = workload.config(size, steps + 2, "cuda")
    for name in ("plain", "sentinel", "sentinel+snapshots", "guard", "watch"):
        if name not in available():
            continue
        cand = available()[name](build_session(loaded))
        batches = [b for _, b in itertools.islice(cand.session.batches, steps + 2)]
        _run(cand, batches[:2])
        torch.cuda.set_sync_debug_mode("warn")
        with cand.attached(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, batch in enumerate(batches[2:]):
                cand.step(i, batch)
        torch.cuda.set_sync_debug_mode("default")
        cand.close()
        out[f"{name} (cuda syncs)"] = sum("synchroniz" in str(w.message) for w in caught) / steps
    return out


# -- time to diagnosis -----------------------------------------------------------------
DIAGNOSIS_REPEATS = 3  # (plain loop, diagnose) pairs behind each time-to-diagnosis figure


@dataclass
class _TimeToAnswer:
    """Diagnose next to the plain loop reaching the failing step, pair by pair."""

    failing_step: int
    plain_s: float  # the plain loop reaching (and running) the failing step: the median
    nandoctor_s: float  # diagnose: the median
    found: str  # what nandoctor reported
    ratios: list[float]  # diagnose / plain, pair by pair

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


@dataclass
class DiagnosisTime(_TimeToAnswer):
    """Verification excluded (fast run, replay, causes); anomaly mode beside it."""

    anomaly_s: float | None = None  # anomaly mode from the start until it raises


def time_to_diagnosis(
    workload: Workload, size: str, device: str, failing_step: int
) -> DiagnosisTime:
    loaded = workload.config(size, failing_step + 10, device, nan_at=failing_step)
    pairs = _beside_plain(loaded, failing_step, DiagnoseOptions(verify=False))
    anomaly = _timed(lambda: _loop_until(loaded, failing_step, anomaly=True))
    return DiagnosisTime(**pairs.fields(failing_step), anomaly_s=anomaly)


@dataclass
class _Pairs:
    plain_s: float
    nandoctor_s: float
    ratios: list[float]
    report: Report

    def fields(self, failing_step: int) -> dict[str, Any]:
        """`_TimeToAnswer`'s fields."""
        return {
            "failing_step": failing_step,
            "plain_s": self.plain_s,
            "nandoctor_s": self.nandoctor_s,
            "found": _found(self.report),
            "ratios": self.ratios,
        }


def _beside_plain(loaded: LoadedConfig, failing_step: int, options: DiagnoseOptions) -> _Pairs:
    """The plain loop's seconds to the failing step and diagnose's, side by side
    `DIAGNOSIS_REPEATS` times, the order alternating (a figure takes minutes, over which
    the machine's load drifts: one pair alone read 1.08x and 1.31x in two runs).
    Diagnose is deterministic: every pair's report is the same."""
    plain: list[float] = []
    ours: list[float] = []
    reports: list[Report] = []

    def run_plain() -> None:
        plain.append(_timed(lambda: _loop_until(loaded, failing_step, anomaly=False)))

    def run_ours() -> None:
        start = time.perf_counter()
        reports.append(diagnose(loaded, options))
        ours.append(time.perf_counter() - start)

    for i in range(DIAGNOSIS_REPEATS):
        for run in (run_plain, run_ours) if i % 2 == 0 else (run_ours, run_plain):
            run()
    ratios = [o / p for o, p in zip(ours, plain, strict=True)]
    return _Pairs(statistics.median(plain), statistics.median(ours), ratios, reports[0])


def _found(report: Report) -> str:
    first = report.first_nonfinite
    return f"step {first.step}, phase {first.phase}, {first.tensor}" if first else report.status


def _loop_until(loaded, failing_step: int, anomaly: bool) -> None:
    session = build_session(loaded)
    with torch.autograd.set_detect_anomaly(anomaly):
        for step, batch in itertools.islice(session.batches, failing_step + 1):
            try:
                plain_step(session, batch)
            except RuntimeError:
                if anomaly and step == failing_step:
                    return  # anomaly mode raised at the NaN: found
                raise


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- the instrumented replay, and the snapshots' memory ------------------------------
def replay_cost(workload: Workload, size: str, device: str, repeats: int = 3) -> Spread:
    """One step under the tracer, as a multiple of one plain step on the same batch."""
    loaded = workload.config(size, 4, device)
    session = build_session(loaded)
    batches = [b for _, b in itertools.islice(session.batches, 2)]
    plain_step(session, batches[0])
    ratios = []
    for _ in range(repeats):
        plain = _timed(lambda: plain_step(session, batches[1]))
        tracer = Tracer(session)

        def traced(t=tracer) -> None:
            with t:
                run_step(session, 1, batches[1], t)

        ratios.append(_timed(traced) / plain)
    return Spread.of(ratios)


@dataclass
class SnapshotMemory:
    state_mb: float  # weights, buffers and optimizer state: what one snapshot copies
    snapshots_mb: float  # everything the store holds: kept states plus the batch ring
    batches_mb: float
    every: int

    @property
    def ratio(self) -> float:
        """(store - batch ring) / state: the target is at most 2."""
        return (self.snapshots_mb - self.batches_mb) / self.state_mb


# NB: the store at its largest: two full periods of the longest auto period (with fewer
# steps, 24 at a period of 32, it held the first snapshots only, taken before the
# optimizer had its state, and read 0.34x)
STORE_STEPS = 2 * AUTO_MAX_EVERY + 2


def snapshot_memory(
    workload: Workload, size: str, device: str, steps: int = STORE_STEPS
) -> SnapshotMemory:
    loaded = workload.config(size, steps, device)
    session = build_session(loaded)
    store = SnapshotStore(session)
    for step, batch in itertools.islice(session.batches, steps):
        store.before_step(step, batch)
        plain_step(session, batch)
    mb = 2**20
    return SnapshotMemory(
        state_bytes(session) / mb, store.nbytes / mb, store.batch_nbytes / mb, store.every or 0
    )


# The plain loop's set-up, for `start_up`: what any training script pays before its first
# step (torch, the model, the optimizer, one step), with nothing of nandoctor's
PLAIN_SET_UP = """
import importlib, sys
import torch
import torch.nn.functional as F
from benchmarks.workloads import SIZES

def entry(spec):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)

model_spec, data_spec, size = sys.argv[1:]
model = entry(model_spec)(**SIZES[size])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
x, y = entry(data_spec)(**SIZES[size], steps=1)[0]
F.cross_entropy(model(x), y).backward()
optimizer.step()
"""
LINTED = "tests/scripts/seed_fp16_nan.py"  # one training script: autocast, GradScaler, a loop


@dataclass
class StartUp:
    """Seconds from launch to exit of a fresh process, each the median of its launches."""

    workload: str
    typer: str  # its version: 0.29 coerces every argument through pydantic (pyproject)
    help: Spread  # nandoctor --help
    lint: Spread  # nandoctor lint LINTED
    plain: Spread  # the plain loop's set-up and first step (PLAIN_SET_UP)
    diagnose: Spread  # nandoctor diagnose on the same workload, --steps 1


def start_up(workload: Workload, size: str, repeats: int) -> StartUp:
    """The commands launched in turn, `repeats` rounds: `--help` and `lint` (a pre-commit
    hook) must not wait for torch; `diagnose --steps 1` next to the plain loop's set-up on
    the same model is what nandoctor adds before a first step (the config's validation,
    the CLI, the engines). nandoctor's bytecode is compiled first, as an install leaves it
    (a checkout under PYTHONDONTWRITEBYTECODE would compile every module at every launch)."""
    import compileall
    import importlib.metadata
    import subprocess
    import sys
    import tempfile

    import yaml

    root = Path(__file__).resolve().parent.parent
    compileall.compile_dir(root / "nandoctor", quiet=1)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / f"{workload.name}.yaml"
        spec = workload.config(size, 1).config.model_dump(mode="json", exclude_unset=True)
        config.write_text(yaml.safe_dump(spec))
        nandoctor = [sys.executable, "-m", "nandoctor"]
        commands = {  # NB: each with the exit codes it may end with
            "help": ([*nandoctor, "--help"], {0}),
            "lint": ([*nandoctor, "lint", LINTED], {0, 1}),
            "plain": (
                [sys.executable, "-c", PLAIN_SET_UP, workload.model, workload.data, size],
                {0},
            ),
            "diagnose": ([*nandoctor, "diagnose", str(config), "--steps", "1", "--quiet"], {0}),
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        env = {**os.environ, "PYTHONPATH": str(root)}  # NB: the config names benchmarks' model
        for _ in range(repeats):
            for name, (argv, codes) in commands.items():
                start = time.perf_counter()
                done = subprocess.run(argv, capture_output=True, text=True, cwd=root, env=env)
                times[name].append(time.perf_counter() - start)
                if done.returncode not in codes:
                    raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr}")
    spreads = {name: Spread.of(t) for name, t in times.items()}
    return StartUp(workload.name, importlib.metadata.version("typer"), **spreads)


def peak_memory(
    workload: Workload, size: str, device: str, steps: int = STORE_STEPS
) -> dict[str, float]:
    """Peak resident memory (MiB) of a fresh process stepping the plain loop, and one
    stepping what `diagnose` runs (sentinel and snapshots): the snapshots' real cost."""
    import subprocess
    import sys

    out = {"steps": float(steps)}
    root = Path(__file__).resolve().parent.parent
    for mode in ("plain", "sentinel+snapshots"):
        code = (
            "from benchmarks.measure import _peak_child; "
            f"_peak_child({workload.name!r}, {size!r}, {device!r}, {steps}, {mode!r})"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
        )
        out[mode] = float(proc.stdout.strip().splitlines()[-1])
    return out


def _peak_child(name: str, size: str, device: str, steps: int, mode: str) -> None:
    from benchmarks.workloads import WORKLOADS
    from nandoctor.runtime.host_memory import keep_freed_memory

    keep_freed_memory()  # NB: as diagnose runs (and the plain loop beside it, alike)

    loaded = WORKLOADS[name].config(size, steps, device)
    cand = available()[mode](build_session(loaded))
    _run(cand, [b for _, b in itertools.islice(cand.session.batches, steps)])
    cand.close()
    print(_own_peak_mib())


def _own_peak_mib() -> float:
    """This process's peak resident memory, MiB. NB: VmHWM, its memory's own high-water
    mark: ru_maxrss also counts the resident set of the parent that spawned it."""
    import resource

    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
