"""The loop a user writes, as a script of its own: what `nandoctor diagnose CONFIG` is timed
against, whole process beside whole process (benchmarks/process.py).

    python -m benchmarks.plain_loop SPEC.json

SPEC names a config's model, data, loss, optimizer, scheduler and device (`spec_of`;
batches are tuples of tensors, as the benchmark's workloads make them). The script
imports torch, builds them in the order `diagnose` does (seeded first, so the weights and
batches are the same) and steps the float32 loop: zero_grad, loss, backward, step, the
scheduler's step. With `stop_at_nonfinite` it reads the loss every step and stops at the
first non-finite one, as a terminate-on-NaN check does. It prints, as JSON, how it ended
and the seconds of the loop alone.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    torch.manual_seed(spec["seed"])
    device = torch.device(spec["device"])
    model = _entry(spec["model"])(**spec["model_args"]).to(device)
    optimizer = _built(torch.optim, spec["optimizer"], model.parameters())
    scheduler = _built(torch.optim.lr_scheduler, spec["scheduler"], optimizer)
    data = _entry(spec["data"])(**spec["data_args"])
    loss_fn = _entry(spec["loss"]) if spec["loss"] else _cross_entropy
    started = time.perf_counter()
    for step, batch in zip(range(spec["steps"]), itertools.cycle(data), strict=False):
        batch = tuple(t.to(device, non_blocking=True) for t in batch)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        if spec["stop_at_nonfinite"] and not math.isfinite(loss.item()):
            print(json.dumps({"nonfinite_at": step, "loop_s": time.perf_counter() - started}))
            return
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    print(json.dumps({"steps": spec["steps"], "loop_s": time.perf_counter() - started}))


def spec_of(config: Any, *, stop_at_nonfinite: bool) -> dict[str, Any]:
    """The plain loop's SPEC for a nandoctor `Config` (float32, a class by name only)."""
    if config.precision.dtype != "float32":
        raise ValueError("the plain script runs float32 loops only (no autocast, no scaler)")

    def by_name(spec: Any) -> dict[str, Any] | None:
        return None if spec is None else {"name": spec.name, "kwargs": spec.kwargs}

    return {
        "seed": config.seed,
        "device": "cpu" if config.device == "auto" else config.device,
        "model": config.model,
        "model_args": config.model_args,
        "data": config.data,
        "data_args": config.data_args,
        "loss": config.loss,
        "optimizer": by_name(config.optimizer),
        "scheduler": by_name(config.scheduler),
        "steps": config.steps,
        "stop_at_nonfinite": stop_at_nonfinite,
    }


def _built(where: Any, spec: dict[str, Any] | None, first: Any) -> Any:
    return None if spec is None else getattr(where, spec["name"])(first, **spec["kwargs"])


def _entry(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _cross_entropy(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


if __name__ == "__main__":
    main(sys.argv[1])
