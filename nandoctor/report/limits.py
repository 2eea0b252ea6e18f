"""The numeric limits the report speaks of, as plain numbers (the report imports no torch).

`setup.dtypes` takes float16's largest value from here, so there is one copy of it.
"""

from __future__ import annotations

import math

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


def overflow_limit(dtype: str) -> float:
    """Where a growing activation of `dtype` makes the run fail: float16's largest value
    (a matmul's output past it is inf); in float32 and bfloat16 the square root of theirs,
    1.8e19: past it the square that a norm's variance, a squared error or a gradient norm
    takes of it overflows (those run in float32 under autocast)."""
    largest = dtype_max(dtype)
    return largest if dtype == "float16" else math.sqrt(largest)


# -log2 of each dtype's smallest subnormal number: torch.finfo(dtype).smallest_normal
# times 2**-(mantissa bits)
SUBNORMAL_BITS = {"float16": 24, "bfloat16": 133, "float32": 149, "float64": 1074}


def underflow_spread(dtype: str) -> float:
    """The spread (max - min) of a softmax row past which its smallest probability rounds
    to exactly 0 in `dtype`: exp(-spread) below half the smallest subnormal, 2**-(bits+1).
    float16: 25 ln 2 = 17.33 (the smallest subnormal itself, 2**-24, at 16.6); bfloat16
    92.9; float32 104.0 (measured: torch.softmax of [0, -s] in each dtype gives 0 past it).
    """
    return (SUBNORMAL_BITS.get(dtype, SUBNORMAL_BITS["float32"]) + 1) * math.log(2)


__all__ = [
    "DTYPE_MAX",
    "FLOAT16_MAX",
    "SUBNORMAL_BITS",
    "dtype_max",
    "overflow_limit",
    "underflow_spread",
]
