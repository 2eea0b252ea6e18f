"""Writes the checkpoints that configs/ resume from: `python -m
nandoctor.examples.make_checkpoints` (deterministic; run it again after changing this).

`configs/checkpoints/nan-weights.pt` is what an unwatched run leaves behind. It trained
the accelerometer classifier of `sensor_windows` in float32 with a plain loop (no
GradScaler, nothing checking the loss), on the data *before* the flat-window fix: at
step 9 the batch holding the flat window was NaN, the backward made every gradient NaN,
and AdamW wrote NaN into every weight. The loop went on and saved a checkpoint every 50
steps; the one of step 150 is what the next run resumes from, on data that is now clean.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from nandoctor.examples import sensor_windows

CHECKPOINTS = Path(__file__).resolve().parents[2] / "configs" / "checkpoints"
HIDDEN = 32  # configs/nonfinite-parameters.yaml builds the model with the same size


def previous_run(steps: int = 150, save_every: int = 50) -> dict:
    """The earlier, unwatched run; returns the last checkpoint it saved."""
    torch.manual_seed(0)
    model = sensor_windows.build_model(hidden=HIDDEN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    loader = sensor_windows.build_loader(batch_size=32, still_at=300)  # the old data
    saved: dict = {}
    step = 0
    while step < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % save_every == 0:  # nobody looked at the loss
                saved = {
                    "model": {k: v.clone() for k, v in model.state_dict().items()},
                    "step": step,
                }
            if step == steps:
                break
    return saved


def main() -> None:
    CHECKPOINTS.mkdir(parents=True, exist_ok=True)
    checkpoint = previous_run()
    path = CHECKPOINTS / "nan-weights.pt"
    torch.save(checkpoint, path)
    bad = {k: int((~torch.isfinite(v)).sum()) for k, v in checkpoint["model"].items()}
    print(f"wrote {path} (step {checkpoint['step']}; non-finite values per tensor: {bad})")


if __name__ == "__main__":
    main()
