"""The optional integrations: a Lightning Callback and a transformers TrainerCallback stop
training at the first non-finite step with the report. Each runs only when its framework
is installed (`pip install 'nandoctor[lightning]'` / `'nandoctor[transformers]'`)."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nandoctor.guard import NonFiniteError
from nandoctor.integrations import MissingExtraError
from nandoctor.integrations.notice import NO_PATH, Handoff, deliver, one_line
from nandoctor.report.types import Cause, Environment, FirstNonfinite, Report


@pytest.mark.parametrize(
    ("module", "blocked"),
    [
        ("lightning", ["lightning", "lightning.pytorch", "pytorch_lightning"]),
        ("transformers", ["transformers"]),
    ],
)
def test_a_missing_framework_is_one_clear_importable_error(monkeypatch, module, blocked):
    for name in blocked:
        monkeypatch.setitem(sys.modules, name, None)  # NB: `import name` now raises
    monkeypatch.delitem(sys.modules, f"nandoctor.integrations.{module}", raising=False)
    with pytest.raises(MissingExtraError, match=f"needs {module}") as caught:
        importlib.import_module(f"nandoctor.integrations.{module}")
    assert isinstance(caught.value, ImportError)
    assert f"nandoctor[{module}]" in caught.value.hint


# -- Lightning ---------------------------------------------------------------------------
def lightning_fit(callback, precision: str = "32-true", nan_batch: int = 3):
    pl = pytest.importorskip("lightning.pytorch")

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    x[nan_batch * 8 + 2, 1] = float("nan")  # batches of 8, not shuffled
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    # NB: on the CPU, Lightning turns precision="16-mixed" into bf16; its plugin keeps fp16
    # autocast with a GradScaler, the path a CUDA run takes
    amp = {"plugins": [pl.plugins.MixedPrecision("16-mixed", "cpu")]}
    trainer = pl.Trainer(
        max_epochs=2,
        callbacks=[callback],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **(amp if precision == "16-mixed" else {"precision": precision}),
    )
    trainer.fit(Classifier(), loader)
    return trainer


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_lightning_callback_stops_at_the_bad_step_with_the_report(precision):
    pytest.importorskip("lightning.pytorch")
    from nandoctor.integrations.lightning import NandoctorCallback

    callback = NandoctorCallback()
    with pytest.raises(NonFiniteError) as caught:
        lightning_fit(callback, precision)
    report = caught.value.report
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (3, "input")
    assert report.environment.grad_scaler is (precision == "16-mixed")
    assert callback.report is report


def test_lightning_callback_can_stop_gracefully(capsys):
    pytest.importorskip("lightning.pytorch")
    from nandoctor.integrations.lightning import NandoctorCallback

    callback = NandoctorCallback(raise_error=False)
    trainer = lightning_fit(callback)
    assert callback.report.first_nonfinite.step == 3
    assert trainer.global_step == 4  # it stopped at the end of the bad step's batch
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]  # not silently
    assert line.startswith("nandoctor: training stopped at step 3 (non-finite values): ")
    assert line.endswith(NO_PATH) and "likely cause: nonfinite-input" in line


def test_lightning_callback_writes_the_report_where_asked(tmp_path, capsys):
    pytest.importorskip("lightning.pytorch")
    from nandoctor.integrations.lightning import NandoctorCallback

    path = tmp_path / "reports" / "nan.json"
    callback = NandoctorCallback(raise_error=False, report_path=path)
    lightning_fit(callback)
    written = Report.from_dict(json.loads(path.read_text()))
    assert written.first_nonfinite.step == 3 and written.to_dict() == callback.report.to_dict()
    assert capsys.readouterr().err.strip().endswith(f"report written to {path}")
    raising = NandoctorCallback(report_path=tmp_path / "raised.json")
    with pytest.raises(NonFiniteError):
        lightning_fit(raising)
    assert json.loads((tmp_path / "raised.json").read_text())["status"] == "nonfinite"


# -- transformers ------------------------------------------------------------------------
class Tiny(nn.Module):
    """A model the Trainer accepts (it returns its loss); NaN enters at forward `nan_at`."""

    def __init__(self, nan_at: int) -> None:
        super().__init__()
        self.net, self.calls, self.nan_at = nn.Linear(8, 3), 0, nan_at

    def forward(self, x, labels=None):
        if self.training:
            x = x * float("nan") if self.calls == self.nan_at else x
            self.calls += 1
        logits = self.net(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def transformers_train(callback, tmp_path, nan_at: int = 3):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it
    torch.manual_seed(0)
    data = [{"x": torch.randn(8), "labels": torch.tensor(i % 3)} for i in range(64)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=10,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=Tiny(nan_at), args=args, train_dataset=data, callbacks=[callback]
    )
    trainer.train()
    return trainer


def test_transformers_callback_stops_at_the_bad_step_with_the_report(tmp_path):
    pytest.importorskip("transformers")
    from nandoctor.integrations.transformers import NandoctorCallback

    callback = NandoctorCallback()
    with pytest.raises(NonFiniteError) as caught:
        transformers_train(callback, tmp_path)
    first = caught.value.report.first_nonfinite
    # NB: the NaN is born inside the model, which returns its loss: the sentinel of
    # diagnose does not check the model's output every step, so the loss is where it
    # shows (the hooked form cannot replay the step to name the op)
    assert (first.step, first.phase) == (3, "loss")


def test_transformers_callback_can_stop_gracefully(tmp_path, capsys):
    pytest.importorskip("transformers")
    from nandoctor.integrations.transformers import NandoctorCallback

    path = tmp_path / "nan.json"
    callback = NandoctorCallback(raise_error=False, report_path=path)
    trainer = transformers_train(callback, tmp_path)
    assert callback.report.first_nonfinite.step == 3
    assert trainer.state.global_step == 4
    assert json.loads(path.read_text())["first_nonfinite"]["step"] == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("nandoctor: training stopped at step 3 (non-finite values): ")
    assert line.endswith(f"report written to {path}")


# -- a NaN label and a learning rate far too high, in both frameworks ------------------------
class Regressor(nn.Module):
    """MSE on float labels; records, per forward, whether its labels were finite and its
    loss, so a test knows the bad step from the model's side (the Trainer shuffles)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.finite_labels: list[bool] = []
        self.losses: list[float] = []

    def forward(self, x, labels):
        out = self.net(x).squeeze(-1)
        loss = F.mse_loss(out, labels)
        self.finite_labels.append(bool(torch.isfinite(labels).all()))
        self.losses.append(loss.item())
        return {"loss": loss, "logits": out}


def regression_data(n: int = 64, nan_label: int | None = None) -> list[dict]:
    torch.manual_seed(0)
    data = [{"x": torch.randn(8), "labels": torch.randn(())} for _ in range(n)]
    if nan_label is not None:
        data[nan_label]["labels"] = torch.tensor(float("nan"))
    return data


def rendered(report: Report) -> str:
    """The terminal and Markdown reports, as a user reads them."""
    from rich.console import Console

    from nandoctor.render.markdown import render_markdown
    from nandoctor.render.terminal import render_report

    console = Console(record=True, width=120, file=open(os.devnull, "w"))  # noqa: SIM115
    render_report(console, report)
    return console.export_text() + render_markdown(report)


def first_bad_loss(model: Regressor) -> int:
    return next(i for i, loss in enumerate(model.losses) if not math.isfinite(loss))


def assert_reads_well(report: Report) -> None:
    text = rendered(report)
    assert "None" not in text, text
    assert f"step {report.first_nonfinite.step}" in text
    # NB: a Trainer's user has no step function for guard.step: `watch` is what localises
    assert "nandoctor watch -- python train.py" in " ".join(report.notes)
    assert "guard.step" not in " ".join(report.notes)


def assert_no_scaler_lines(report: Report) -> None:
    """A run without a GradScaler is never shown code that calls one."""
    assert not report.environment.grad_scaler
    text = rendered(report)
    assert not any(call in text for call in ("scaler.scale(", "scaler.step(", "scaler.update("))


def hf_regression(tmp_path, data, lr: float, optim: str = "adamw_torch"):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from nandoctor.integrations.transformers import NandoctorCallback

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=30,
        per_device_train_batch_size=4,
        learning_rate=lr,
        lr_scheduler_type="constant",
        optim=optim,
        max_grad_norm=0.0,  # NB: the Trainer clips at 1.0 by default, which tames any lr
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    model = Regressor()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, callbacks=[NandoctorCallback()]
    )
    with pytest.raises(NonFiniteError) as caught:
        trainer.train()
    return model, caught.value.report


def test_transformers_nan_label_is_the_input_of_its_step(tmp_path):
    model, report = hf_regression(tmp_path, regression_data(nan_label=13), lr=1e-3)
    bad_step = model.finite_labels.index(False)  # the Trainer shuffled: ask the model
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (bad_step, "input")
    assert report.causes[0].id == "nonfinite-input"
    assert_reads_well(report)


def test_transformers_learning_rate_too_high_fails_at_the_overflowing_loss(tmp_path):
    model, report = hf_regression(tmp_path, regression_data(), lr=1.0, optim="sgd")
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (
        first_bad_loss(model),
        "loss",
    )
    assert first_bad_loss(model) > 1, "finite steps first: the run diverged, not a bad batch"
    assert report.causes[0].id in ("learning-rate-too-high", "exploding-gradients")
    assert_reads_well(report)
    assert_no_scaler_lines(report)


def lightning_regression(lr: float, nan_label: int | None = None):
    pl = pytest.importorskip("lightning.pytorch")
    from nandoctor.integrations.lightning import NandoctorCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Regressor()

        def training_step(self, batch, batch_idx):
            return self.model(batch["x"], batch["labels"])["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=lr)

    module = Module()
    loader = torch.utils.data.DataLoader(regression_data(nan_label=nan_label), batch_size=8)
    trainer = pl.Trainer(
        max_epochs=5,
        callbacks=[NandoctorCallback()],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(NonFiniteError) as caught:
        trainer.fit(module, loader)
    return module.model, caught.value.report


def test_lightning_nan_label_is_the_input_of_its_step():
    """`training_step` calls the network on `x` alone: the label is seen in the batch the
    callback hands to the guard (`on_train_batch_start`)."""
    model, report = lightning_regression(lr=0.01, nan_label=3 * 8 + 5)
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (3, "input")
    assert model.finite_labels.index(False) == 3
    assert report.causes[0].id == "nonfinite-input"
    assert_reads_well(report)


def test_lightning_learning_rate_too_high_fails_at_the_overflowing_loss():
    model, report = lightning_regression(lr=10.0)
    assert (report.first_nonfinite.step, report.first_nonfinite.phase) == (
        first_bad_loss(model),
        "loss",
    )
    assert first_bad_loss(model) > 1
    assert report.causes[0].id in ("learning-rate-too-high", "exploding-gradients")
    assert_reads_well(report)
    assert_no_scaler_lines(report)


# -- the one line, without a framework --------------------------------------------------
def test_the_one_line_says_what_happened_and_where_the_report_is(tmp_path):
    report = Report(
        "guard",
        "train.py",
        Environment("cpu", "2", "float32", False, 1),
        "nonfinite",
        3,
        summary="step 3, phase input: the batch held non-finite values",
        first_nonfinite=FirstNonfinite(3, "input"),
        causes=[Cause("nonfinite-input", "t", 0.99)],
    )
    where = deliver(report, tmp_path / "r.json")
    assert one_line(report, where) == (
        "nandoctor: training stopped at step 3 (non-finite values): step 3, phase input: the "
        f"batch held non-finite values; likely cause: nonfinite-input; report written to "
        f"{tmp_path / 'r.json'}"
    )
    assert Report.from_dict(json.loads((tmp_path / "r.json").read_text())) == report
    assert deliver(report, None) == NO_PATH
    handoff = Handoff(raise_error=True, report_path=None)
    with pytest.raises(NonFiniteError):
        handoff(report)
    handoff(report)  # handed over once
