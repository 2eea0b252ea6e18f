"""A Lightning `Callback` that stops training at the first non-finite step, with the
report of `diagnose`::

    from nandoctor.integrations.lightning import NandoctorCallback

    trainer = L.Trainer(callbacks=[NandoctorCallback()])
    trainer.fit(model, loader)      # raises nandoctor.NonFiniteError at the first bad step

With `raise_error=False` the trainer stops gracefully at the end of that batch instead,
`callback.report` holds the report, and one line on stderr says what happened and where
the report is. `report_path` writes the report there as JSON, either way. The guard
watches through hooks (Lightning runs the step, so nothing can replay it): the report
names the step, the phase and what the telemetry says, not the tensor. Steps are
numbered like `trainer.global_step`. A forecast (a failure seen coming) is one warning
through Lightning's logger (`lightning.pytorch.nandoctor`) the moment it fires, and in
the report.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from nandoctor.guard import Guard, NonFiniteError
from nandoctor.integrations import MissingExtraError
from nandoctor.integrations.notice import CALLBACK_NOTE, Handoff, forecast_logger
from nandoctor.report.types import Report

try:  # NB: the unified package first; its Callback is not the standalone package's
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef, import-not-found, unused-ignore]
    except ImportError:
        raise MissingExtraError("lightning", "lightning", "lightning") from None

LOG = logging.getLogger(f"{pl.__name__}.nandoctor")


class NandoctorCallback(pl.Callback):
    def __init__(
        self, *, raise_error: bool = True, report_path: str | os.PathLike[str] | None = None
    ) -> None:
        self.raise_error = raise_error
        self.report_path = report_path
        self.report: Report | None = None
        self._guard: Guard | None = None
        self._handoff = Handoff(raise_error, report_path)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.optimizers:
            return
        precision = getattr(trainer, "precision_plugin", None)
        self._guard = Guard(
            pl_module,
            trainer.optimizers[0],
            getattr(precision, "scaler", None),
            start_step=trainer.global_step,
            name=type(pl_module).__name__,
            raise_error=False,  # NB: the callback raises, once the report is handed over
            on_forecast=forecast_logger(LOG),
        )
        self._guard.hooked_note = CALLBACK_NOTE
        for optimizer in trainer.optimizers[1:]:
            self._guard.run.note_optimizer(optimizer)
        self._guard.__enter__()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any
    ) -> None:
        if self._guard is not None:
            self._guard.note_batch(batch)  # NB: labels too; training_step may not pass them

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        if self._guard is not None and self._guard.report is not None:
            self.report = self._guard.report
            trainer.should_stop = True
            self._handoff(self.report)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.close()
            self.report = self.report or guard.report
        if self.report is not None:
            self._handoff(self.report)

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, NonFiniteError):
            self.report = exception.report
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.__exit__(type(exception), exception, None)


__all__ = ["NandoctorCallback"]
