"""`python -m benchmarks`: run every figure, print a table, write docs/performance.md.

python -m benchmarks                       # CPU sizes, under 15 minutes on 2 quiet cores
python -m benchmarks --quick               # the same figures, fewer rounds: under 5 minutes
python -m benchmarks --size tiny --rounds 1 --steps 2 --failing-step 6 --out -   # smoke
python -m benchmarks --size gpu --device cuda   # on a GPU (see benchmarks/gpu_check.sh)

Each figure prints a line as it is measured (with the minutes so far), so a run cut short
still says what it found.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import measure, process
from benchmarks.render import render_markdown, render_png
from benchmarks.workloads import WORKLOADS

STEP_WORKLOADS = [
    "transformer-bf16", "mlp-fp16", "mlp-bf16", "convnet-bf16",
    "transformer-fp32", "mlp-fp32", "mlp-wide-fp32", "convnet-fp32",
]  # fmt: skip
# the whole-process figures: a 20-30 ms float32 MLP step, and a transformer's
PROCESS_WORKLOADS = ["mlp-wide-fp32", "transformer-fp32"]
# NB: the instruction sets that decide how fast a CPU runs half precision
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
# --quick: the same figures, each smaller (every one of them still runs)
QUICK = {
    "rounds": 5, "steps": 5, "step_budget": 10.0, "failing_step": 60,
    "workloads": PROCESS_WORKLOADS, "process_seconds": 8.0, "process_pairs": 2,
    "verified_milestone": 300, "verified_pairs": 2, "start_up_repeats": 3,
}  # fmt: skip


class Clock:
    """Prints each figure's line as it comes, with the minutes since the start."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def say(self, line: str) -> None:
        print(f"[{self.minutes:5.1f} min] {line}", file=sys.stderr, flush=True)

    @property
    def minutes(self) -> float:
        return (time.perf_counter() - self.start) / 60


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == _parser().get_default(key):
                setattr(args, key, value)
    if args.threads:  # NB: the launched processes too (the environment they inherit)
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.manual_seed(0)
    clock = Clock()
    results: dict = {"machine": machine(args), "size": args.size, "device": args.device}
    clock.say(_machine_line(results["machine"]))
    results["process"] = _whole_processes(args, clock)
    results["verified_process"] = _verified(args, clock)
    results["step_times"] = _step_times(args, clock)
    args.focus = _focus(args.focus, results["machine"])
    results["focus"] = args.focus
    focus = WORKLOADS[args.focus]
    # NB: on a GPU every workload: its synchronisations per step are the figure to settle
    step_names = args.workloads or STEP_WORKLOADS
    read_names = step_names if args.device.startswith("cuda") else [args.focus, "mlp-fp16"]
    results["host_reads"] = {
        w: measure.host_reads(WORKLOADS[w], args.size, args.device) for w in read_names
    }
    diagnosis = measure.time_to_diagnosis(focus, args.size, args.device, args.failing_step)
    results["time_to_diagnosis"] = {**dataclasses.asdict(diagnosis), "ratio": diagnosis.ratio}
    clock.say(f"time to diagnosis, in process, {args.focus}: {diagnosis.ratio:.2f}x")
    results["replay_cost"] = dataclasses.asdict(measure.replay_cost(focus, args.size, args.device))
    kept = WORKLOADS[args.memory_workload]
    memory = measure.snapshot_memory(kept, args.size, args.device)
    results["snapshot_memory"] = {**dataclasses.asdict(memory), "ratio": memory.ratio}
    results["memory_workload"] = args.memory_workload
    peak = results["peak_memory_mb"] = measure.peak_memory(kept, args.size, args.device)
    clock.say(
        f"snapshot memory, {args.memory_workload}: {memory.ratio:.2f}x the state "
        f"({memory.state_mb:.1f} MiB); peak of a fresh process "
        f"{peak['sentinel+snapshots'] - peak['plain']:+.0f} MiB over the plain loop's"
    )
    if args.start_up_repeats:
        start = measure.start_up(WORKLOADS["mlp-fp32"], args.size, args.start_up_repeats)
        results["start_up"] = dataclasses.asdict(start)
        clock.say(f"start-up: --help {start.help.median:.2f} s, lint {start.lint.median:.2f} s")
    results["minutes"] = clock.minutes
    text = render_markdown(results, command=_command(argv if argv is not None else sys.argv[1:]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
        render_png(results, Path(args.out).with_name("performance.png"))
        print(text)
    return 0


def _whole_processes(args: argparse.Namespace, clock: Clock) -> list[dict]:
    """`nandoctor diagnose` beside the plain script, per workload (benchmarks/process.py)."""
    out = []
    for name in args.process_workloads:
        steps = process.steps_for(WORKLOADS[name], args.size, args.device, args.process_seconds)
        clock.say(f"whole process, {name}: {steps} steps, {_pairs(args.process_pairs)}")
        times = process.process_times(
            WORKLOADS[name], args.size, steps, args.process_pairs, args.device, say=clock.say
        )
        r = times.ratio
        clock.say(
            f"whole process, {name} ({times.step_ms:.1f} ms a step): diagnose / plain "
            f"{r['wall'].median:.3f}x wall ({r['loop'].median:.3f}x the loop alone), "
            f"{r['sys'].median:.2f}x system time, "
            f"{r['peak'].median:.2f}x peak memory; / plain with its malloc {r['own'].median:.3f}x"
        )
        out.append(dataclasses.asdict(times))
    return out


def _verified(args: argparse.Namespace, clock: Clock) -> dict:
    name = args.verified_workload
    clock.say(
        f"verified time to diagnosis, whole process, {name}: learning rate x"
        f"{process.VERIFIED_GAMMA:g} at step {args.verified_milestone}, "
        f"{_pairs(args.verified_pairs)}"
    )
    verified = process.verified_process(
        WORKLOADS[name],
        args.size,
        args.verified_milestone,
        args.verified_pairs,
        args.device,
        say=clock.say,
    )
    clock.say(f"verified time to diagnosis: {verified.ratio:.2f}x ({verified.found})")
    return {**dataclasses.asdict(verified), "ratio": verified.ratio}


def _step_times(args: argparse.Namespace, clock: Clock) -> list[dict]:
    out = []
    for name in args.workloads or STEP_WORKLOADS:
        times = measure.step_times(
            WORKLOADS[name], args.size, args.device, args.rounds, args.steps, args.step_budget
        )
        ratio = times.ratio.get("sentinel+snapshots")
        said = f"{ratio.median:.3f}x" if ratio is not None else "-"
        clock.say(
            f"in process, {name} ({times.ms['plain'].median:.1f} ms a step): "
            f"sentinel+snapshots / plain {said}"
        )
        out.append(dataclasses.asdict(times))
    return out


def _pairs(n: int) -> str:
    return f"{n} pair" if n == 1 else f"{n} pairs"


def _machine_line(m: dict) -> str:
    flags = m.get("cpu_flags") or {}
    has = " ".join(name for name, on in flags.items() if on) or "none known"
    return f"{m['cpu']}, {m['cores']} cores, {m['threads']} torch threads; {has}"


def _command(argv: list[str]) -> str:
    """The command that reproduces the page: this one, less where it wrote its output."""
    shown, skip = ["python -m benchmarks"], False
    for arg in argv:
        if skip or arg.startswith(("--json=", "--out=")):
            skip = False
            continue
        skip = arg in ("--json", "--out")
        if not skip:
            shown.append(arg)
    return " ".join(shown)


def _focus(focus: str, machine: dict) -> str:
    """`auto`: the bfloat16 transformer where the CPU runs bfloat16 matmuls natively (or
    on a GPU), else the float32 one (emulated bfloat16 takes seconds a step there)."""
    if focus != "auto":
        return focus
    flags = machine.get("cpu_flags") or {}
    native = machine.get("gpu") or flags.get("avx512_bf16") or flags.get("amx_bf16")
    return "transformer-bf16" if native else "transformer-fp32"


def machine(args: argparse.Namespace) -> dict:
    cpu, flags = "unknown CPU", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown CPU":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass

    gpu = (
        torch.cuda.get_device_name()
        if args.device == "cuda" and torch.cuda.is_available()
        else None
    )
    return {
        "cpu": cpu,
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS} if flags else None,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": gpu,
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument(
        "--quick", action="store_true", help="every figure, fewer rounds: under 5 minutes"
    )
    p.add_argument("--size", choices=["tiny", "cpu", "gpu"], default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads, here and in every process launched (default: torch's); on a "
        "machine busy with other work, 1 keeps the figures from measuring the contention",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=9, help="rounds per step-time figure")
    p.add_argument(
        "--steps", type=int, default=10, help="turns per round (a step of each candidate)"
    )
    p.add_argument(
        "--failing-step", type=int, default=150, help="where the time-to-diagnosis run fails"
    )
    p.add_argument(
        "--focus",
        default="auto",
        help="the workload of the detailed figures (auto: transformer-bf16 where the CPU "
        "has avx512_bf16 or amx_bf16, or on a GPU; else transformer-fp32)",
    )
    p.add_argument(
        "--process-workloads",
        nargs="*",
        default=PROCESS_WORKLOADS,
        help="the workloads of the whole-process figures",
    )
    p.add_argument(
        "--process-seconds",
        type=float,
        default=15.0,
        help="seconds of plain steps in each whole-process run (its steps follow; the "
        "start-up, a few seconds of it torch's, comes on top)",
    )
    p.add_argument(
        "--process-pairs", type=int, default=3, help="plain and diagnose processes, pairs"
    )
    p.add_argument(
        "--verified-workload",
        default="mlp-wide-fp32",
        help="the run of the verified diagnosis (a float32 workload)",
    )
    p.add_argument(
        "--verified-milestone",
        type=int,
        default=1000,
        help="the step its learning rate jumps at (it fails a few dozen steps later)",
    )
    p.add_argument(
        "--verified-pairs", type=int, default=2, help="its plain and diagnose processes, pairs"
    )
    p.add_argument(
        "--memory-workload",
        default="mlp-wide-fp32",
        help="the workload of the snapshot memory figures",
    )
    p.add_argument("--workloads", nargs="*", help="only these step-time workloads")
    p.add_argument(
        "--start-up-repeats",
        type=int,
        default=5,
        help="launches of each start-up command (0: no start-up figure)",
    )
    p.add_argument(
        "--step-budget",
        type=float,
        default=measure.STEP_BUDGET_S,
        help="seconds of step-time turns per workload, at most (fewer rounds beyond it)",
    )
    p.add_argument(
        "--out", default="docs/performance.md", help="the Markdown page ('-': stdout only)"
    )
    p.add_argument("--json", help="also write the raw results here")
    return p


if __name__ == "__main__":
    raise SystemExit(main())
