"""The numeric limits the report speaks of, as plain numbers (the report imports no torch).

`setup.dtypes` takes float16's largest value from here, so there is one copy of it.
"""

from __future__ import annotations

FLOAT16_MAX = 65504.0  # the largest finite float16: torch.finfo(torch.float16).max

__all__ = ["FLOAT16_MAX"]
