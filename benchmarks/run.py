"""`python -m benchmarks`: run every figure, print a table, write docs/performance.md.

python -m benchmarks                       # CPU sizes, about 30 minutes on 2 cores
python -m benchmarks --size tiny --rounds 1 --steps 2 --failing-step 6 --out -   # smoke
python -m benchmarks --size gpu --device cuda   # on a GPU (see benchmarks/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from benchmarks import measure
from benchmarks.render import render_markdown, render_png
from benchmarks.workloads import WORKLOADS

STEP_WORKLOADS = [
    "transformer-bf16", "mlp-fp16", "mlp-bf16", "convnet-bf16",
    "transformer-fp32", "mlp-fp32", "convnet-fp32",
]  # fmt: skip
# NB: the instruction sets that decide how fast a CPU runs half precision
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    torch.manual_seed(0)
    results: dict = {"machine": machine(args), "size": args.size, "device": args.device}
    step_names = args.workloads or STEP_WORKLOADS
    results["step_times"] = [
        dataclasses.asdict(
            measure.step_times(
                WORKLOADS[w], args.size, args.device, args.rounds, args.steps, args.step_budget
            )
        )
        for w in step_names
    ]
    args.focus = _focus(args.focus, results["machine"])
    results["focus"] = args.focus
    focus = WORKLOADS[args.focus]
    # NB: on a GPU every workload: its synchronisations per step are the figure to settle
    read_names = step_names if args.device.startswith("cuda") else [args.focus, "mlp-fp16"]
    results["host_reads"] = {
        w: measure.host_reads(WORKLOADS[w], args.size, args.device) for w in read_names
    }
    diagnosis = measure.time_to_diagnosis(focus, args.size, args.device, args.failing_step)
    results["time_to_diagnosis"] = {**dataclasses.asdict(diagnosis), "ratio": diagnosis.ratio}
    verified = measure.time_to_verified_diagnosis(
        WORKLOADS[args.verified_workload], args.size, args.device, args.verified_failing_step
    )
    results["time_to_verified_diagnosis"] = {
        **dataclasses.asdict(verified),
        "workload": args.verified_workload,
        "ratio": verified.ratio,
    }
    results["replay_cost"] = dataclasses.asdict(measure.replay_cost(focus, args.size, args.device))
    memory = measure.snapshot_memory(focus, args.size, args.device)
    results["snapshot_memory"] = {**dataclasses.asdict(memory), "ratio": memory.ratio}
    results["peak_memory_mb"] = measure.peak_memory(focus, args.size, args.device)
    if args.start_up_repeats:
        start = measure.start_up(WORKLOADS["mlp-fp32"], args.size, args.start_up_repeats)
        results["start_up"] = dataclasses.asdict(start)
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
    import os

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
    p.add_argument("--size", choices=["tiny", "cpu", "gpu"], default="cpu")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=9, help="rounds per step-time figure")
    p.add_argument(
        "--steps", type=int, default=10, help="turns per round (a step of each candidate)"
    )
    p.add_argument(
        "--failing-step", type=int, default=300, help="where the time-to-diagnosis run fails"
    )
    p.add_argument(
        "--focus",
        default="auto",
        help="the workload of the detailed figures (auto: transformer-bf16 where the CPU "
        "has avx512_bf16 or amx_bf16, or on a GPU; else transformer-fp32)",
    )
    p.add_argument(
        "--verified-workload", default="mlp-fp32", help="the run of the verified diagnosis"
    )
    p.add_argument(
        "--verified-failing-step",
        type=int,
        default=1000,
        help="where the run of the verified diagnosis fails",
    )
    p.add_argument("--workloads", nargs="*", help="only these step-time workloads")
    p.add_argument(
        "--start-up-repeats",
        type=int,
        default=7,
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
