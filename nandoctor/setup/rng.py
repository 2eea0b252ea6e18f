"""The global random number generators' states: Python's, numpy's (when the user's code
imported it), torch's and CUDA's. A snapshot captures them so that a replayed step draws
what the step drew; the batch stream captures them where each epoch began, so that a
replay resumed in a fresh session shuffles the epochs after it as the run did."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class RngState:
    python: Any
    numpy: Any
    torch: Tensor  # NB: `Tensor`, not `torch.Tensor`: this field's name hides the module here
    cuda: list[Tensor] | None

    @classmethod
    def capture(cls) -> RngState:
        numpy = sys.modules.get("numpy")
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return cls(
            random.getstate(),
            numpy.random.get_state() if numpy is not None else None,
            torch.get_rng_state(),
            cuda,
        )

    def restore(self) -> None:
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
