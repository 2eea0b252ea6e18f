"""The numeric limits the report speaks of, as plain numbers (the report imports no torch).

`setup.dtypes` takes float16's largest value from here, so there is one copy of it.
"""

from __future__ import annotations

FLOAT16_MAX = 65504.0  # the largest finite float16: torch.finfo(torch.float16).max

# torch.finfo(dtype).max of each dtype a run computes in
DTYPE_MAX = {
    "float16": FLOAT16_MAX,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
}


def dtype_max(dtype: str) -> float:
    """The largest finite value of `dtype` (float32's for a dtype not listed)."""
    return DTYPE_MAX.get(dtype, DTYPE_MAX["float32"])


__all__ = ["DTYPE_MAX", "FLOAT16_MAX", "dtype_max"]
