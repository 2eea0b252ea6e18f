"""Names of the three training dtypes and their aliases (float16's largest value, which
the report speaks of, is `report.limits.FLOAT16_MAX`).

>>> canonical_dtype("bf16")
'bfloat16'
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
ALIASES: dict[str, str] = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
}


def canonical_dtype(name: str) -> str:
    """The canonical name for `name` or one of its aliases; ValueError when unknown."""
    key = str(name).strip().lower().removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key not in DTYPES:
        known = ", ".join([*DTYPES, *ALIASES])
        raise ValueError(f"unknown dtype {name!r}: expected one of {known}")
    return key


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[canonical_dtype(name)]
