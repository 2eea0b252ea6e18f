"""The forecast everywhere a run is watched: `diagnose` (JSON, terminal, Markdown, JUnit,
exit codes with --fail-on-forecast, TensorBoard), `Guard`, and the Lightning and
transformers callbacks (`watch`: tests/cli/test_watch.py, beside diagnose's own report)."""

from __future__ import annotations

import io
import json
import logging
import warnings
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.guard import ForecastWarning, Guard, NonFiniteError
from nandoctor.render.terminal import render_report
from nandoctor.report.types import Report
from tests.helpers.paths import CONFIGS

runner = CliRunner()
SEED = str(CONFIGS / "seed-fp16-nan.yaml")  # goes non-finite at step 26
BEFORE = 16  # steps replayed: 10 before the failure


def diagnose(*args: str, tmp_path) -> tuple[int, dict, str]:
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["diagnose", *args, "--no-verify", "--json", str(out)])
    return result.exit_code, json.loads(out.read_text()), result.output


@pytest.fixture(scope="module")
def seed_before(tmp_path_factory) -> tuple[int, dict, str]:
    """The seed example replayed to 10 steps before its failure."""
    return diagnose(SEED, "--steps", str(BEFORE), tmp_path=tmp_path_factory.mktemp("seed"))


def test_the_seed_replayed_to_10_steps_before_its_failure_carries_a_log_of_softmax_forecast(
    seed_before,
):
    code, report, _ = seed_before
    assert code == 0 and report["status"] == "healthy"  # every step finite: exit 0
    (forecast,) = [f for f in report["forecast"] if f["kind"] == "log-of-softmax"]
    assert forecast["step"] < BEFORE and forecast["metric"] == "softmax_spread"
    assert (forecast["module"], forecast["op"]) == (None, "aten._softmax.default")  # the loss
    assert forecast["limit"] == pytest.approx(17.33, abs=0.01)  # float16's underflow
    assert 0 < forecast["value"] < forecast["limit"] and forecast["eta_steps"] > 0
    assert 0 < forecast["confidence"] <= 1 and "grew" in forecast["why"]
    assert set(forecast) == {
        "step", "kind", "module", "op", "metric", "value", "limit", "eta_steps",
        "confidence", "why",
    }  # fmt: skip
    event = {"step": forecast["step"], "kind": "forecast", "cause": "log-of-softmax",
             "eta_steps": forecast["eta_steps"]}  # fmt: skip
    assert event in report["events"]
    assert all("cause" not in e for e in report["events"] if e["kind"] == "scaler-skip")


def test_the_terminal_shows_a_forecast_panel_with_the_cause_s_fix(seed_before):
    _, data, output = seed_before
    assert "FORECAST" in output and "HEALTHY" in output
    assert "log-of-softmax in about" in output
    report = Report.from_dict(data)
    console = Console(file=io.StringIO(), width=100, force_terminal=False)
    render_report(console, report)
    text = console.file.getvalue()
    assert "fix: Use `F.cross_entropy(logits, target)`" in text


def test_fail_on_forecast_makes_a_finite_run_with_a_forecast_fail(tmp_path):
    junit, markdown = tmp_path / "r.xml", tmp_path / "r.md"
    args = ["diagnose", SEED, "--steps", str(BEFORE), "--no-verify", "-q", "--fail-on-forecast"]
    result = runner.invoke(app, [*args, "--junit", str(junit), "--markdown", str(markdown)])
    assert result.exit_code == 1, result.output
    assert "HEALTHY, FORECAST" in result.output and "forecast: step" in result.output
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert cases["no forecast"].find("failure") is not None
    assert cases["finite run"].find("failure") is None
    text = markdown.read_text()
    assert text.startswith("## ❌ nandoctor diagnose `seed-fp16-nan`: log-of-softmax forecast")
    assert "### Forecast" in text and "**fix:**" in text


def test_a_healthy_run_carries_an_empty_forecast(tmp_path):
    code, report, output = diagnose(str(CONFIGS / "seed-fixed.yaml"), "--steps", "60",
                                    "--fail-on-forecast", "-q", tmp_path=tmp_path)  # fmt: skip
    assert code == 0, output
    assert report["forecast"] == [] and not any(e["kind"] == "forecast" for e in report["events"])


def test_a_failed_run_says_how_long_before_the_failure_each_forecast_came(tmp_path):
    code, data, _ = diagnose(SEED, "-q", tmp_path=tmp_path)
    assert code == 1 and data["first_nonfinite"]["step"] == 26
    first = min(data["forecast"], key=lambda f: f["step"])
    assert 26 - first["step"] >= 10  # in time
    console = Console(file=io.StringIO(), width=100)
    render_report(console, Report.from_dict(data))
    assert f"{26 - first['step']} steps before the failure" in console.file.getvalue()


def test_tensorboard_gets_the_signals_as_scalars_and_each_forecast_as_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    args = ["diagnose", SEED, "--steps", str(BEFORE), "--no-verify", "-q"]
    result = runner.invoke(app, [*args, "--tensorboard", str(logdir)])
    assert result.exit_code == 0, result.output
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    spread = acc.Scalars("nandoctor/forecast/softmax_spread")
    assert [e.step for e in spread] == list(range(BEFORE))
    assert 0 < spread[-1].value < 1  # a fraction of its limit
    assert "nandoctor/forecast/update_ratio/param_groups.0" in tags["scalars"]
    assert "nandoctor/forecast/activation_peak" in tags["scalars"]
    assert "nandoctor/forecast/text_summary" in tags["tensors"]


# -- Guard -----------------------------------------------------------------------------------
def diverging_loop(steps: int = 60):
    """Least squares under SGD just past its stable rate: each step overshoots further, the
    gradient norm grows ~1.8x a step and the loss overflows float32 near step 70."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, generator=g)
    batches = []
    for _ in range(16):
        x = torch.randn(64, 16, generator=g)
        batches.append((x, x @ w + 0.1 * torch.randn(64, generator=g)))
    torch.manual_seed(0)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.15)

    def train_step(batch):
        x, y = batch
        optimizer.zero_grad()
        F.mse_loss(model(x).squeeze(-1), y).backward()
        optimizer.step()

    return model, optimizer, [batches[i % 16] for i in range(steps)], train_step


def test_guard_warns_once_the_moment_a_forecast_fires_with_its_step_and_eta():
    model, optimizer, batches, train_step = diverging_loop()
    guard = Guard(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            guard.step(train_step, batch)
    guard.close()
    said = [w for w in caught if issubclass(w.category, ForecastWarning)]
    assert guard.forecasts and len(said) == len(guard.forecasts)
    first = min(guard.forecasts, key=lambda f: f.step)
    assert str(said[0].message).startswith(
        f"nandoctor: forecast at step {first.step}: {first.kind} in about {first.eta_steps} steps"
    )
    assert said[0].filename == __file__  # pointed at the user's own line


def test_guard_hands_each_forecast_to_on_forecast_and_into_the_report():
    model, optimizer, batches, train_step = diverging_loop(steps=120)
    told = []
    with pytest.raises(NonFiniteError) as failed, Guard(model, optimizer, on_forecast=told.append):
        for batch in batches:
            train_step(batch)
    report = failed.value.report
    assert told and report.forecast == sorted(told, key=lambda f: (-f.confidence, f.due, f.step))
    assert all(f.step < report.first_nonfinite.step - 10 for f in told)


def test_guard_without_forecast_measures_nothing():
    model, optimizer, batches, train_step = diverging_loop()
    guard = Guard(model, optimizer, forecast=False)
    for batch in batches:
        guard.step(train_step, batch)
    guard.close()
    assert guard.forecasts == [] and guard.result.signals is None


# -- the callbacks: a warning through their frameworks' loggers ------------------------------
class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_lightning_callback_warns_of_a_forecast_through_lightning_s_logger():
    pl = pytest.importorskip("lightning.pytorch")
    from nandoctor.integrations.lightning import LOG, NandoctorCallback

    model, _, batches, _ = diverging_loop(steps=40)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.15)

    capture = Capture()
    LOG.addHandler(capture)
    try:
        trainer = pl.Trainer(
            max_steps=40, callbacks=[NandoctorCallback()], accelerator="cpu", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Module(), torch.utils.data.DataLoader(batches, batch_size=None))
    finally:
        LOG.removeHandler(capture)
    assert LOG.name == "lightning.pytorch.nandoctor"
    assert capture.lines and capture.lines[0].startswith("nandoctor: forecast at step ")


def test_the_transformers_callback_warns_of_a_forecast_through_transformers_logger(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from nandoctor.integrations.transformers import LOG, NandoctorCallback

    linear, _, batches, _ = diverging_loop(steps=40)

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = linear

        def forward(self, x, labels):
            return {"loss": F.mse_loss(self.net(x).squeeze(-1), labels)}

    data = [{"x": x[i], "labels": y[i]} for x, y in batches[:16] for i in range(64)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=40, per_device_train_batch_size=64,
        learning_rate=1.15, lr_scheduler_type="constant", optim="sgd", max_grad_norm=0.0,
        use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    capture = Capture()
    LOG.addHandler(capture)
    try:
        callback = NandoctorCallback(raise_error=False)
        transformers.Trainer(
            model=Regressor(), args=args, train_dataset=data, callbacks=[callback]
        ).train()
    finally:
        LOG.removeHandler(capture)
    assert LOG.name == "transformers.nandoctor"
    assert capture.lines and capture.lines[0].startswith("nandoctor: forecast at step ")
