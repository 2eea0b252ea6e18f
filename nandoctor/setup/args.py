"""`model_args` and `data_args` with YAML's numeric strings read as numbers.

YAML 1.1 (PyYAML) reads `lr: 1e-5` (no dot) as the string "1e-5", which a builder then
multiplies or compares as text. The optimizer's keys are converted in the schema; the
builders' keys the same way here, each conversion named in a note of the report, since a
builder might have wanted the string.
"""

from __future__ import annotations

from typing import Any

from nandoctor.setup.schema import Config, as_number


def numeric_args(args: dict[str, Any]) -> dict[str, Any]:
    """`args` with each top-level numeric string as its number."""
    return {k: as_number(v) if isinstance(v, str) else v for k, v in args.items()}


def conversion_notes(config: Config) -> list[str]:
    """One note per converted key: `model_args.lr: "1e-5" is text in YAML; passed as the
    number 1e-05 (write 1.0e-5 for a YAML number)`."""
    notes = []
    for section in ("model_args", "data_args"):
        for key, value in getattr(config, section).items():
            number = as_number(value) if isinstance(value, str) else value
            if isinstance(value, str) and number is not value and number != value:
                notes.append(
                    f'{section}.{key}: "{value}" is text in YAML; passed as the number '
                    f"{number!r} (write 1.0e-5, not 1e-5, for a YAML number)"
                )
    return notes
