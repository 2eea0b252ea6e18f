"""A transformers `TrainerCallback` that stops training at the first non-finite step,
with the report of `diagnose`::

    from nandoctor.integrations.transformers import NandoctorCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[NandoctorCallback()])
    trainer.train()                 # raises nandoctor.NonFiniteError at the first bad step

With `raise_error=False` the trainer stops at the end of that step instead
(`control.should_training_stop`), `callback.report` holds the report, and one line on
stderr says what happened and where the report is. `report_path` writes the report there
as JSON, either way. The guard watches through hooks (the Trainer runs the step, so
nothing can replay it): the report names the step, the phase and what the telemetry
says, not the tensor. Steps are numbered like `state.global_step`; the GradScaler of
`fp16=True` is found when it scales the first loss. A forecast (a failure seen coming)
is one warning through transformers' logger (`transformers.nandoctor`) the moment it
fires, and in the report.
"""

from __future__ import annotations

import os
from typing import Any

from nandoctor.guard import Guard
from nandoctor.integrations import MissingExtraError
from nandoctor.integrations.notice import CALLBACK_NOTE, Handoff, forecast_logger
from nandoctor.report.types import Report

try:
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
except ImportError:
    raise MissingExtraError("transformers", "transformers", "transformers") from None

LOG = hf_logging.get_logger("transformers.nandoctor")


class NandoctorCallback(TrainerCallback):
    def __init__(
        self, *, raise_error: bool = True, report_path: str | os.PathLike[str] | None = None
    ) -> None:
        self.raise_error = raise_error
        self.report_path = report_path
        self.report: Report | None = None
        self._guard: Guard | None = None
        self._handoff = Handoff(raise_error, report_path)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            return
        self._guard = Guard(
            model,
            optimizer,
            start_step=state.global_step,
            name=type(model).__name__,
            raise_error=False,  # NB: the callback raises, once the report is handed over
            on_forecast=forecast_logger(LOG),
        )
        self._guard.hooked_note = CALLBACK_NOTE
        self._guard.__enter__()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._guard is not None and self._guard.report is not None:
            self.report = self._guard.report
            control.should_training_stop = True
            if self.raise_error:
                self._detach()
            self._handoff(self.report)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()
        if self.report is not None:
            self._handoff(self.report)

    def _detach(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.close()
            self.report = self.report or guard.report


__all__ = ["NandoctorCallback"]
