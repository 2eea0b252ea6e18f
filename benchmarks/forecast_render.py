"""The measured part of docs/forecast.md, from `benchmarks.forecast`'s figures: what the
forecast saw coming on its corpus, and what its signals cost a step. The page's prose is
written by hand; this part sits between its two markers and is replaced at each run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from nandoctor.report.forecast import forecast_text

if TYPE_CHECKING:
    from benchmarks.forecast import Outcome

CALIBRATION = """\
The bars were set on this corpus (`benchmarks/forecast_corpus.py`): runs that fail by
growth, each by its own road, and healthy runs that look alarming without failing
(warmup, a cosine schedule, a plateau, a GradScaler's calibration skips, a hand-written
log(softmax) whose logits level off). A forecast is in time when it fires at least
{min_lead} steps before the failure; a forecast on a healthy run is a false alarm. The
lead is also given as a share of the steps the run took to fail. Reproduce: `python -m
benchmarks.forecast` (the runs use {threads} torch thread(s): a run's numbers, and so the
step it fails at, can move with the thread count).
"""


def render(
    outcomes: list[Outcome], costs: list[dict], machine: str, args: argparse.Namespace
) -> str:
    from benchmarks.forecast import MIN_LEAD

    lines = [CALIBRATION.format(min_lead=MIN_LEAD, threads=args.threads)]
    lines += _summary(outcomes)
    lines += _growth_table([o for o in outcomes if o.growth])
    lines += _healthy_table([o for o in outcomes if not o.growth])
    lines += _first_forecasts([o for o in outcomes if o.growth and o.first is not None])
    if costs:
        lines += _costs(costs, machine, args)
    return "\n".join(lines).rstrip() + "\n"


def _summary(outcomes: list[Outcome]) -> list[str]:
    growth = [o for o in outcomes if o.growth]
    healthy = [o for o in outcomes if not o.growth]
    in_time = sum(o.in_time for o in growth)
    alarms = sum(o.false_alarms for o in healthy)
    return [
        f"**{in_time} of {len(growth)}** growth failures forecast at least 10 steps before "
        f"the failure (target: at least 2/3); **{alarms} false alarms** on {len(healthy)} "
        "healthy runs (target: none).",
        "",
    ]


def _growth_table(outcomes: list[Outcome]) -> list[str]:
    out = [
        "### Runs that fail by growth",
        "",
        "| run | first forecast at step | cause forecast | failed at step | lead (steps) "
        "| lead (% of run) | in time |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        first = o.first
        failed = o.failed_at
        lead = o.lead
        known = lead is not None and failed is not None
        pct = f"{100 * lead / (failed + 1):.0f}%" if known else "-"  # type: ignore[operator]
        out.append(
            f"| {o.name} | {first.step if first else '-'} | {first.kind if first else '-'} "
            f"| {failed if failed is not None else 'did not fail'} | {_or(lead)} | {pct} "
            f"| {'yes' if o.in_time else 'no'} |"
        )
    return [*out, ""]


def _healthy_table(outcomes: list[Outcome]) -> list[str]:
    out = [
        "### Healthy runs",
        "",
        "| run | steps | stayed finite | forecasts (false alarms) |",
        "|---|---|---|---|",
    ]
    for o in outcomes:
        said = "; ".join(f"{f.kind} at step {f.step}" for f in o.forecasts) or "none"
        finite = "yes" if o.failed_at is None else f"no: step {o.failed_at}"
        out.append(f"| {o.name} | {o.steps} | {finite} | {len(o.forecasts)}: {said} |")
    return [*out, ""]


def _first_forecasts(outcomes: list[Outcome]) -> list[str]:
    out = ["### What each first forecast said", ""]
    for o in outcomes:
        assert o.first is not None
        out.append(f"- **{o.name}**: {forecast_text(o.first)}")
    return [*out, ""]


def _costs(costs: list[dict], machine: str, args: argparse.Namespace) -> list[str]:
    out = [
        "### Cost a step",
        "",
        "Per-step time of nandoctor's step with the sentinel alone and with the forecast's "
        "signals too, beside the plain loop, measured in one process, the candidates taking "
        "turns a step each (as docs/performance.md does; median over rounds, with the "
        f"range). torch {machine}; workload size `{args.size}` (docs/performance.md's "
        f"workloads); {args.rounds} rounds of "
        f"{args.steps} steps. Target: the sentinel with the signals within the sentinel's "
        "1.03x of the plain loop.",
        "",
        "| workload | plain | sentinel / plain | sentinel+forecast / plain "
        "| sentinel+forecast / sentinel | met |",
        "|---|---|---|---|---|---|",
    ]
    for c in costs:
        ratio: dict[str, Any] = c["ratio"]
        plain = c["ms"]["plain"]["median"]
        sentinel, both = ratio["sentinel"], ratio["sentinel+forecast"]
        added = both["median"] / sentinel["median"]
        met = "yes" if both["median"] <= 1.03 else "**no**"
        out.append(
            f"| {c['workload']} | {plain:.1f} ms | {_spread(sentinel)} | {_spread(both)} "
            f"| {added:.3f}x | {met} |"
        )
    added_ms = [f"{c['workload']} +{_added_ms(c):.2f} ms" for c in costs]
    out += [
        "",
        "What the signals add to the sentinel's step, in time: " + ", ".join(added_ms) + ".",
    ]
    return [*out, ""]


def _added_ms(c: dict) -> float:
    return c["ms"]["sentinel+forecast"]["median"] - c["ms"]["sentinel"]["median"]


def _spread(s: dict[str, float]) -> str:
    return f"{s['median']:.3f}x ({s['low']:.2f}–{s['high']:.2f})"


def _or(value: object) -> str:
    return "-" if value is None else str(value)


START, END = "<!-- measured: start -->", "<!-- measured: end -->"


def replace_measured(page: str, measured: str) -> str:
    """`page` with the text between its markers replaced by `measured` (appended, with
    the markers, to a page that has none)."""
    block = f"{START}\n{measured.rstrip()}\n{END}"
    if START in page and END in page:
        return page[: page.index(START)] + block + page[page.index(END) + len(END) :]
    return page.rstrip() + "\n\n" + block + "\n"
