"""The divergence rule: a metric rising far above its recent level, while still finite."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.report.divergence import (
    MIN_RATIO,
    WARMUP,
    divergence_events,
    divergence_text,
    first_divergence,
)
from nandoctor.report.telemetry import Telemetry
from tests.helpers.project import base_config

runner = CliRunner()


def noisy(n: int, level: float = 1.0, spread: float = 0.3, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [level * math.exp(rng.gauss(0, spread)) for _ in range(n)]


def test_a_climb_far_above_the_recent_level_is_an_event_with_its_numbers():
    values = [*noisy(40), *(10.0 ** (k + 1) for k in range(6))]  # 10, 100, 1000, ...
    event = first_divergence(range(len(values)), values, "loss")
    assert event is not None
    # 10 and 100 stay under 100x the level (which 10 nudged up); 1000 is the first over
    assert (event.step, event.kind, event.metric, event.value) == (42, "divergence", "loss", 1e3)
    assert 0.7 < event.baseline < 1.4
    assert divergence_text(event).startswith("loss diverged at step 42: 1e+03, ")


@pytest.mark.parametrize("seed", range(5))
def test_noise_and_a_slow_trend_are_not_divergence(seed):
    values = [v * (1 + 0.05 * i) for i, v in enumerate(noisy(200, spread=0.8, seed=seed))]
    assert first_divergence(range(200), values, "grad_norm") is None


def test_the_warmup_steps_are_never_judged():
    values = [1.0, 1e3, 1e-2, 5e2, *noisy(30)]  # a wild start, back where it began
    assert first_divergence(range(len(values)), values, "loss") is None
    assert WARMUP >= 4


def test_a_loss_that_diverges_at_once_and_stays_is_an_event_against_its_first_value():
    """A far too high learning rate (a Trainer at lr 1e3: 0.39, then 5.9e6, 1.7e8, ...)
    diverges inside the warmup, which then took ~1e7 for the normal level: no event, a
    CI gate on --fail-on-divergence passed it."""
    values = [0.39, 5.9e6, 1.7e8, *(v * 3e7 for v in noisy(37, spread=1.0))]
    event = first_divergence(range(len(values)), values, "loss")
    assert event is not None and (event.step, event.value, event.baseline) == (1, 5.9e6, 0.39)
    assert first_divergence(range(len(values)), values, "grad_norm") is None  # loss only


def test_a_language_models_loss_that_jumps_100x_at_step_1_and_stays_has_diverged():
    """pytorch/examples' word_language_model, a Transformer under AdamW at its default
    lr 20: 9.1, then 1.3e4 and ~5e3 from then on (550x its start; the gradient norm
    0.76, then ~300). It printed no divergence: the rule asked for 10^4x."""
    values = [9.1, 12864.3, 45634.7, 26767.2, 33133.6, 34291.9, 11098.4, 11493.4, 9080.3]
    values += [v * 5e3 for v in noisy(40, spread=0.3)]
    event = first_divergence(range(len(values)), values, "loss")
    assert event is not None and (event.step, event.value, event.baseline) == (1, 12864.3, 9.1)


def test_a_loss_that_leaves_its_start_by_less_or_comes_back_is_not_that():
    assert first_divergence(range(40), [0.39, *(v * 30 for v in noisy(39))], "loss") is None
    back = [0.39, 5.9e6, 1.7e8, 3e7, 1.0, *noisy(35)]  # a spike that heals in the warmup
    assert first_divergence(range(40), back, "loss") is None
    assert first_divergence(range(6), [0.39, 5.9e6, 1.7e8, 3e7, 2e7, 4e7], "loss") is None


def test_a_jump_below_the_ratio_is_not_divergence():
    values = [*noisy(40, spread=0.01), MIN_RATIO / 2]
    assert first_divergence(range(41), values, "grad_norm") is None


def test_non_finite_values_are_the_failure_not_a_divergence():
    values = [*noisy(40), math.inf, math.nan]
    assert first_divergence(range(42), values, "loss") is None


def test_one_event_per_metric_in_step_order():
    climb = [*noisy(30), *(10.0 ** (k + 1) for k in range(5))]
    t = Telemetry(list(range(35)), climb, [*noisy(33), 1e4, 1e6], [None] * 35)
    assert [(e.step, e.metric) for e in divergence_events(t)] == [(32, "loss"), (33, "grad_norm")]


REGRESSION = """
import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Linear(8, 1)


def build_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(4)]


def loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()
"""


def regression(lr: float) -> dict:
    return base_config(
        data="train.py:build_data",
        model="train.py:build_model",
        loss="train.py:loss",
        optimizer={"name": "SGD", "lr": lr},
        steps=40,
    )


def test_a_finite_explosion_carries_a_divergence_event_and_can_fail_ci(project, tmp_path):
    """SGD at lr 0.8 on least squares: the loss grows ~2x a step, finite for 40 steps."""
    config = project(regression(0.8), REGRESSION)
    out = tmp_path / "r.json"
    result = runner.invoke(app, ["diagnose", str(config), "-q", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["status"] == "healthy"
    (event,) = [e for e in report["events"] if e["kind"] == "divergence" and e["metric"] == "loss"]
    assert event["value"] >= MIN_RATIO * event["baseline"]
    assert f"loss diverged at step {event['step']}" in result.output
    assert f"but the loss diverged at step {event['step']}" in report["summary"]
    assert ": HEALTHY\n" in result.output  # information only, by default
    junit, markdown = tmp_path / "r.xml", tmp_path / "r.md"
    reports = ("--junit", str(junit), "--markdown", str(markdown))
    failing = runner.invoke(app, ["diagnose", str(config), "-q", "--fail-on-divergence", *reports])
    assert failing.exit_code == 1
    assert ": HEALTHY, DIVERGED\n" in failing.output  # the headline agrees with the exit code
    assert 'failures="1"' in junit.read_text()  # and so does every report CI reads
    assert f"❌ nandoctor diagnose: diverged at step {event['step']}" in markdown.read_text()
    panel = runner.invoke(app, ["diagnose", str(config), "--fail-on-divergence"])
    assert f"DIVERGED at step {event['step']} (every step finite)" in panel.output
    assert "HEALTHY" not in panel.output


def test_a_healthy_run_has_no_divergence(project):
    config = project(regression(0.05), REGRESSION)
    result = runner.invoke(app, ["diagnose", str(config), "-q", "--fail-on-divergence"])
    assert result.exit_code == 0, result.output
    assert "diverged" not in result.output


@pytest.mark.parametrize(
    ("config", "seed", "lr_scale"),
    [("seed-fixed", 0, 1.0), ("seed-fixed", 1, 1.0), ("attention-masked-ok", 0, 3.0)],
)
def test_shipped_healthy_configs_raise_no_divergence(config, seed, lr_scale):
    """seed-fixed's gradient norm jumps 15x above its average at step 16 (the model leaves
    its plateau); attention-masked-ok at 3x its learning rate trains better. Neither is
    divergence."""
    from nandoctor.diagnose import engine
    from nandoctor.setup.load import load_config
    from tests.helpers.paths import CONFIGS

    loaded = load_config(CONFIGS / f"{config}.yaml")
    optimizer = loaded.config.optimizer
    faster = optimizer.model_copy(update={"lr": optimizer.model_extra["lr"] * lr_scale})
    loaded = loaded.with_overrides(steps=40, seed=seed, optimizer=faster)
    report = engine.diagnose(loaded, engine.DiagnoseOptions(verify=False))
    assert report.status == "healthy"
    assert [e for e in report.events if e.kind == "divergence"] == []


THE_SAME_LOOP = """
import sys
import torch
from train import build_data, build_model, loss

model, data = build_model(), build_data()
manual = sys.argv[1] == "manual"  # the update written by hand, as SGD makes it
optimizer = None if manual else torch.optim.SGD(model.parameters(), lr=0.8)
for step in range(40):
    batch = data[step % len(data)]
    model.zero_grad(set_to_none=True)
    loss(model, batch).backward()
    if manual:
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.8)
    else:
        optimizer.step()
"""


@pytest.mark.slow
def test_a_finite_explosion_is_the_same_divergence_whatever_drives_the_loop(
    project, tmp_path, monkeypatch
):
    """`diagnose` on the config, and `watch` on the same loop written as a script, with
    SGD and with its update by hand (no optimizer): one divergence, at one step, said in
    each summary."""
    config = project(regression(0.8), REGRESSION)
    (tmp_path / "loop.py").write_text(THE_SAME_LOOP)
    out = tmp_path / "r.json"
    runner.invoke(app, ["diagnose", str(config), "-q", "--json", str(out)])
    reports = {"diagnose": json.loads(out.read_text())}
    monkeypatch.chdir(tmp_path)
    for update in ("optimizer", "manual"):
        command = ["watch", "-q", "--json", str(out), "--", sys.executable, "loop.py", update]
        assert runner.invoke(app, command).exit_code == 0
        reports[f"watch, {update}"] = json.loads(out.read_text())
    events = {
        name: [(e["step"], e["metric"]) for e in r["events"] if e["kind"] == "divergence"]
        for name, r in reports.items()
    }
    assert events["diagnose"] and all(found == events["diagnose"] for found in events.values())
    step = events["diagnose"][0][0]
    assert all(f"but the loss diverged at step {step}" in r["summary"] for r in reports.values())
