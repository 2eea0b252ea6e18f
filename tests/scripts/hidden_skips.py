"""A float16 loop whose backward makes a NaN at every EVERY-th step from FIRST on, while
its loss stays finite: the loss adds 0 x sqrt(0), whose derivative is inf (0 x inf is NaN
at any loss scale). The GradScaler skips each of those steps and halves its scale; the
steps between are clean, so the skips are scattered and the scale only collapses to 1
many steps later. No nandoctor in it.

python hidden_skips.py [FIRST] [EVERY] [STEPS] [MODE] [STATE_FILE]

MODE says how the loop backwards, the NaN always in the first loss term:
- plain: `scaler.scale(loss).backward()`;
- twoscaled: two terms scaled apart, then summed: `(scale(a) + scale(b)).backward()`;
- retain: `scale(a).backward(retain_graph=True)`, then `scale(b).backward()` through it;
- differs: as plain, but the runs differ as unseeded ones do: the first run's NaN steps
  are FIRST, FIRST + EVERY, ...; every later run's are shifted by one (STATE_FILE says).
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _hidden(t: torch.Tensor) -> torch.Tensor:
    return 0.0 * torch.sqrt((t - t.detach()).float().pow(2).sum())


def main(first: int, every: int, steps: int, mode: str, state: Path | None) -> None:
    torch.manual_seed(0)
    if mode == "differs" and state is not None:
        first += 1 if state.exists() else 0
        state.write_text("ran")
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        bad = step >= first and (step - first) % every == 0
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
            a = F.cross_entropy(logits.float(), y) + (_hidden(logits) if bad else 0.0)
            b = logits.float().pow(2).mean() * 1e-3
        if mode == "twoscaled":
            (scaler.scale(a) + scaler.scale(b)).backward()
        elif mode == "retain":
            scaler.scale(a).backward(retain_graph=True)
            scaler.scale(b).backward()
        else:
            scaler.scale(a).backward()
        scaler.step(optimizer)
        scaler.update()
    print("done")


if __name__ == "__main__":
    args = [*sys.argv[1:], *("4", "3", "80", "plain")[len(sys.argv) - 1 :]]
    state = Path(args[4]) if len(args) > 4 else None
    main(int(args[0]), int(args[1]), int(args[2]), args[3], state)
