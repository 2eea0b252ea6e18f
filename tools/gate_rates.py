"""Measure the baseline gate's false alarms and catches, and the divergence rule's, on
real runs (the numbers docs/ci.md quotes).

    python tools/gate_rates.py OUT                    # runs, then prints the table
    python tools/gate_rates.py OUT --table            # the table from runs already in OUT

Variants of each shipped healthy config (other seeds, learning rates 0.3x-10x; 150
steps of seed-fixed, 60 of attention-masked-ok) are run
against the config's own baseline (seed 0, its own lr). A variant that stays finite and
trains about as well (final loss at most 1.5x the baseline's) is *healthy*: the gate
must pass it, and each failure is a false alarm. A variant that stays finite but trains
worse is *stressed*: listed with what the gate said, counted in neither rate.
Regressions must fail it: one layer's weights doubled once, before training (the last or
the first Linear layer), and a change that keeps the first Linear layer's output doubled
(or 8x) every step, as a lost scaling factor does ("headroom-halved", "headroom-8x").
Each run is one `diagnose` with the health probe,
saved as a report in OUT, so the table can be recomputed as the rule changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nandoctor.diagnose import engine  # noqa: E402
from nandoctor.gate.check import Tolerances, gate_of  # noqa: E402
from nandoctor.report.divergence import divergence_events  # noqa: E402
from nandoctor.report.types import Report  # noqa: E402
from nandoctor.setup.load import load_config  # noqa: E402

# per config: its steps, its healthy variants (seed, lr scale) and its regressions (the
# transformer is ~5x slower a step on a CPU: fewer runs of it)
CONFIGS = {
    "seed-fixed": (
        150,
        [(seed, lr) for seed in (0, 1, 2) for lr in (1.0, 3.0)] + [(0, 0.3), (1, 10.0)],
        ("weights-doubled", "first-layer-doubled", "headroom-halved", "headroom-8x"),
    ),
    "attention-masked-ok": (
        60,
        [(0, 1.0), (1, 1.0), (0, 3.0), (0, 0.3)],
        ("headroom-halved", "headroom-8x"),
    ),
    # seed-fixed with its first layer's output kept 32x larger: activations in the
    # thousands, the few % of float16's range where halving the headroom matters
    "seed-fixed-hot": (
        150,
        [(0, 1.0), (1, 1.0), (2, 1.0), (0, 0.3)],
        ("weights-doubled", "first-layer-doubled", "headroom-halved"),
    ),
}
HOT = 32.0
# the gate of earlier versions, for comparison: the dynamics checks at their old defaults
OLD = Tolerances(max_activation_growth=1.5, max_gradient_growth=2.0, max_loss_increase=0.1)


def run(config: str, seed: int, lr_scale: float, regression: str | None, steps: int) -> Report:
    hot = config.endswith("-hot")
    loaded = load_config(REPO / "configs" / f"{config.removesuffix('-hot')}.yaml")
    optimizer = loaded.config.optimizer
    scaled = optimizer.model_copy(update={"lr": optimizer.model_extra["lr"] * lr_scale})
    loaded = loaded.with_overrides(steps=steps, seed=seed, optimizer=scaled)
    options = engine.DiagnoseOptions(verify=False, measure_health=True, gate=False)

    def on_session(session) -> None:
        first = next(m for m in session.model.modules() if isinstance(m, torch.nn.Linear))
        if hot:
            first.register_forward_hook(lambda _m, _i, out: out * HOT)
        if regression is not None:
            _break(session.model, regression)

    return engine.diagnose(loaded, options, on_session=on_session)


def _break(model: torch.nn.Module, regression: str) -> None:
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if regression.startswith("headroom"):
        factor = 8.0 if regression == "headroom-8x" else 2.0
        linears[0].register_forward_hook(lambda _m, _i, out: out * factor)
        return
    layer = linears[-1] if regression == "weights-doubled" else linears[0]
    with torch.no_grad():
        layer.weight.mul_(2.0)


def cases() -> list[tuple[str, int, float, str | None]]:
    out: list[tuple[str, int, float, str | None]] = []
    for config, (_, healthy, regressions) in CONFIGS.items():
        out += [(config, seed, lr, None) for seed, lr in healthy]
        out += [(config, 0, 1.0, r) for r in regressions]
    return out


def name(config: str, seed: int, lr: float, regression: str | None) -> str:
    return f"{config}-seed{seed}-lr{lr:g}" + (f"-{regression}" if regression else "")


def table(out: Path, tol: Tolerances) -> str:
    rows = [
        "| run | kind | final loss | divergence | gate | failed checks | old gate |",
        "|---|---|---|---|---|---|---|",
    ]
    alarms = catches = healthy = broken = diverged = old_alarms = old_catches = 0
    for config, seed, lr, regression in cases():
        path = out / f"{name(config, seed, lr, regression)}.json"
        base = out / f"{name(config, 0, 1.0, None)}.json"
        if not path.exists() or not base.exists():
            continue
        report, baseline = (Report.from_dict(json.loads(p.read_text())) for p in (path, base))
        assert report.health is not None and baseline.health is not None
        env = report.environment
        gate = gate_of(report.health, env.dtype, tol, baseline.health, "b", env.grad_scaler)
        failed = [c.name for c in gate.checks if not c.passed] if gate else []
        old = gate_of(report.health, env.dtype, OLD, baseline.health, "b", env.grad_scaler)
        old_failed = [c.name for c in old.checks if not c.passed] if old else []
        if not report.healthy:
            failed.append("non-finite")
            old_failed.append("non-finite")
        div = bool(divergence_events(report.telemetry))  # NB: the rule as it is now
        final, base_final = report.health.final_loss, baseline.health.final_loss
        kind = _kind(report, regression, final, base_final)
        if kind == "healthy":
            healthy += 1
            alarms += bool(failed)
            old_alarms += bool(old_failed)
            diverged += div
        elif kind == "regression":
            broken += 1
            catches += bool(failed)
            old_catches += bool(old_failed)
        verdict = "fail" if failed else "pass"
        loss = f"{final:.3g}" if final is not None else "-"
        cells = [path.stem, kind, loss, "yes" if div else "no", verdict, ", ".join(failed)]
        cells.append(", ".join(old_failed) or "pass")
        rows.append("| " + " | ".join(cells) + " |")
    rows.append("")
    rows.append(f"false alarms: {alarms} of {healthy} healthy runs (old gate: {old_alarms})")
    rows.append(f"divergence events on healthy runs: {diverged}")
    rows.append(f"catches: {catches} of {broken} regressions (old gate: {old_catches})")
    return "\n".join(rows)


def _kind(report: Report, regression: str | None, final, base_final) -> str:
    if regression is not None:
        return "regression"
    if not report.healthy or final is None or base_final is None:
        return "stressed"
    return "healthy" if final <= 1.5 * base_final else "stressed"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table:
        for case in cases():
            path = args.out / f"{name(*case)}.json"
            if not path.exists():
                path.write_text(run(*case, steps=CONFIGS[case[0]][0]).to_json())
                print("ran", path.stem, flush=True)
    print(table(args.out, Tolerances()))


if __name__ == "__main__":
    main()
