"""Names of the three training dtypes and their aliases (float16's largest value, which
the report speaks of, is `report.limits.FLOAT16_MAX`).

>>> canonical_dtype("bf16")
'bfloat16'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# NB: names only, so that the config's schema (and `nandoctor schema`, `--help`) can check a
# dtype without importing torch; `torch_dtype` looks the name up in torch when a run needs it.
DTYPES: tuple[str, ...] = ("float16", "bfloat16", "float32")
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
    import torch

    return getattr(torch, canonical_dtype(name))
