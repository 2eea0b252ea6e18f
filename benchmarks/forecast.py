"""`python -m benchmarks.forecast`: the forecast measured on its corpus, and what its signals
cost a step; writes the measured part of docs/forecast.md (between its markers).

    python -m benchmarks.forecast                   # the corpus and the cost, ~10 minutes
    python -m benchmarks.forecast --only seed-fp16-nan --no-cost --out -

For each run of `benchmarks.forecast_corpus`: the step the first forecast fired at, the
step the run failed at (the sentinel's first bad step), the lead (steps, and per cent of
the steps the run took to fail), and on the healthy runs every forecast made, each a
false alarm. The cost: the per-step time of the sentinel with the signals
(`sentinel+forecast`) beside the sentinel alone and the plain loop, in one process, the
candidates taking turns (`benchmarks.measure.step_times`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.forecast_corpus import ROOT, CorpusRun, corpus
from nandoctor.report.forecast import Forecast
from nandoctor.runtime.fast_run import fast_run
from nandoctor.setup.load import LoadedConfig, load_config
from nandoctor.setup.schema import Config
from nandoctor.setup.session import build_session

MIN_LEAD = 10  # steps: a forecast this early counts as in time (issue 48's bar)
COST_WORKLOADS = ("mlp-fp32", "mlp-fp16", "transformer-fp32")
COST_CANDIDATES = ("plain", "sentinel", "sentinel+forecast")


@dataclass
class Outcome:
    name: str
    growth: bool
    steps: int  # the steps the run was given
    failed_at: int | None  # the first bad step (None: healthy to the end)
    forecasts: list[Forecast] = field(default_factory=list)  # in the order they fired
    seconds: float = 0.0

    @property
    def first(self) -> Forecast | None:
        return min(self.forecasts, key=lambda f: f.step, default=None)

    @property
    def lead(self) -> int | None:
        first = self.first
        if first is None or self.failed_at is None or first.step >= self.failed_at:
            return None
        return self.failed_at - first.step

    @property
    def in_time(self) -> bool:
        return self.lead is not None and self.lead >= MIN_LEAD

    @property
    def false_alarms(self) -> int:
        return 0 if self.growth else len(self.forecasts)


def loaded(run: CorpusRun) -> LoadedConfig:
    if run.shipped is not None:
        return load_config(ROOT / "configs" / run.shipped)
    return LoadedConfig(Config.model_validate(run.config), ROOT / "benchmarks" / "corpus.yaml")


def measure(run: CorpusRun) -> Outcome:
    """The run under the sentinel with the forecast, to its first bad step or its end."""
    config = loaded(run)
    torch.manual_seed(0)
    session = build_session(config)
    started = time.perf_counter()
    result = fast_run(session, config.config.steps, forecast=True)
    seconds = time.perf_counter() - started
    failed = result.failure.step if result.failure is not None else None
    fired = sorted(result.forecasts, key=lambda f: f.step)
    return Outcome(run.name, run.growth, config.config.steps, failed, fired, seconds)


def cost(size: str, rounds: int, steps: int) -> list[dict]:
    from benchmarks import measure as bench
    from benchmarks.workloads import WORKLOADS

    return [
        dataclasses.asdict(
            bench.step_times(WORKLOADS[w], size, "cpu", rounds, steps, only=COST_CANDIDATES)
        )
        for w in COST_WORKLOADS
    ]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    runs = [r for r in corpus() if not args.only or r.name in args.only]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)  # NB: the corpus's numbers depend on it (reductions)
    outcomes = []
    for run in runs:
        outcome = measure(run)
        outcomes.append(outcome)
        print(_line(outcome), file=sys.stderr, flush=True)
    costs = [] if args.no_cost else cost(args.size, args.rounds, args.steps)
    machine = _machine()
    torch.set_num_threads(threads)
    from benchmarks.forecast_render import render, replace_measured

    text = render(outcomes, costs, machine, args)
    if args.json:
        data = {"outcomes": [dataclasses.asdict(o) for o in outcomes], "costs": costs}
        Path(args.json).write_text(json.dumps(data, indent=1))
    if args.out == "-":
        sys.stdout.write(text)
    else:
        page = Path(args.out)
        page.write_text(replace_measured(page.read_text() if page.exists() else "", text))
    return 0


def _line(o: Outcome) -> str:
    first = o.first
    said = f"first forecast at {first.step} ({first.kind})" if first else "no forecast"
    end = f"failed at {o.failed_at}" if o.failed_at is not None else "healthy"
    return f"{o.name}: {end}; {said}; lead {o.lead}; {len(o.forecasts)} forecasts"


def _machine() -> str:
    threads = torch.get_num_threads()
    return f"{torch.__version__}, {threads} thread" + ("s" if threads != 1 else "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.forecast", description=__doc__)
    p.add_argument("--only", nargs="*", help="corpus runs by name")
    p.add_argument("--out", default=str(ROOT / "docs" / "forecast.md"), help="'-' for stdout")
    p.add_argument("--json", help="also write the raw figures here")
    p.add_argument("--no-cost", action="store_true", help="skip the per-step cost")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (the corpus's numbers depend on it)"
    )
    p.add_argument("--size", default="cpu", help="the cost's workload size")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=5)
    return p


if __name__ == "__main__":
    raise SystemExit(main())
