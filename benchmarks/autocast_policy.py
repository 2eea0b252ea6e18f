"""What emulating CUDA's autocast lists costs a CPU step, against what the casts cost.

Three timings of the same small training step (Linear, layer_norm, GELU, softmax, log,
mean; float16 autocast): CPU autocast's own lists (`native`), CUDA's lists emulated
(`cuda`), and `native` with the casts CUDA would make written by hand (`.float()` before
each op CUDA runs in float32): the casts themselves, with no emulation machinery.
The emulation's overhead is `cuda / hand-cast`.

    python -m benchmarks.autocast_policy [--steps 200] [--width 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from nandoctor.setup.cuda_autocast import emulated


class Block(nn.Module):
    def __init__(self, width: int, hand_cast: bool) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, 10)
        self.norm = nn.LayerNorm(width)
        self.hand_cast = hand_cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.norm(h.float() if self.hand_cast else h)  # layer_norm: float32 on CUDA
        logits = self.out(nn.functional.gelu(h))
        if self.hand_cast:
            logits = logits.float()  # softmax and log: float32 on CUDA
        return torch.log(torch.softmax(logits, -1) + 1e-4).mean()


def step_ms(width: int, steps: int, *, emulate: bool, hand_cast: bool) -> float:
    torch.manual_seed(0)
    model = Block(width, hand_cast)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, width)
    times = []
    with emulated() if emulate else _nothing():
        for _ in range(steps):
            start = time.perf_counter()
            with torch.autocast("cpu", torch.float16):
                loss = model(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1000


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    native = step_ms(args.width, args.steps, emulate=False, hand_cast=False)
    hand = step_ms(args.width, args.steps, emulate=False, hand_cast=True)
    cuda = step_ms(args.width, args.steps, emulate=True, hand_cast=False)
    print(f"native {native:.3f} ms  hand-cast {hand:.3f} ms  cuda (emulated) {cuda:.3f} ms")
    print(f"emulation / hand-cast = {cuda / hand:.3f}   emulation / native = {cuda / native:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
