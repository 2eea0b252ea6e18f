"""A plain float32 loop whose failure at step 3 comes back exactly, comes back with other
values, or does not come back at all when the step is run again. No nandoctor in it.

    python flaky_step.py exact      # an empty example at step 3: sqrt's backward at 0
    python flaky_step.py noisy      # the same, its logits nudged by noise from os.urandom
    python flaky_step.py bitflip MARKER   # no empty example: the first run of step 3 flips
                                          # an exponent bit of one activation (MARKER: a
                                          # file it leaves behind, so a rerun does not)

`make(mode, flipped)` builds the same loop for a test that drives it itself (`Guard`):
`flipped` is the "did it flip already" of that process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

FAIL_AT = 3
STEPS = 6


class Encoder(nn.Module):
    """Features, then a head; the loss adds the features' mean norm (sqrt of a sum of
    squares), whose derivative at an all-zero row is infinite."""

    def __init__(self, noisy: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16, bias=False)
        self.head = nn.Linear(16, 3)
        self.noisy = noisy
        self.fault: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        if self.fault is not None:
            self.fault(h)
        logits = self.head(torch.relu(h))
        if self.noisy:  # NB: not from torch's generator: a snapshot cannot replay it
            noise = int.from_bytes(os.urandom(2), "little") * 1e-9
            logits = logits + torch.tensor([noise, 0.0, 0.0])  # one class's logit, nudged
        return logits, h.pow(2).sum(-1).sqrt().mean()


def batches(empty_at: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        if step == empty_at:
            x[0] = 0.0  # an empty example: its features are all zero
        out.append((x, y))
    return out


def flip_once(already: Callable[[], bool]) -> Callable[[torch.Tensor], None]:
    """A fault that sets every exponent bit of one activation (a NaN), the first time the
    step runs only: `already()` says whether it happened before."""

    def fault(h: torch.Tensor) -> None:
        if not already():
            with torch.no_grad():
                h.view(torch.int32)[0, 0] |= 0x7F800000

    return fault


def make(mode: str, flipped: Callable[[], bool] = lambda: True):
    """The model, its optimizer, the batches and the step, as the loop below runs them."""
    torch.manual_seed(0)
    model = Encoder(noisy=mode == "noisy")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(None if mode == "bitflip" else FAIL_AT)

    def train_step(step: int, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        model.fault = flip_once(flipped) if mode == "bitflip" and step == FAIL_AT else None
        optimizer.zero_grad()
        logits, norm = model(x)
        loss = F.cross_entropy(logits, y) + 0.01 * norm
        loss.backward()
        optimizer.step()
        return loss

    return model, optimizer, data, train_step


def main(mode: str, marker: Path | None) -> None:
    def flipped() -> bool:  # NB: the first run of the command leaves the marker behind
        if marker is None or marker.exists():
            return True
        marker.write_text("flipped")
        return False

    _, _, data, train_step = make(mode, flipped)
    for step, batch in enumerate(data):
        train_step(step, batch)
    print("trained", STEPS, "steps")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else None)
