"""The sentinel inside a user's own training loop: `Guard` and `NonFiniteError`.

    guard = nandoctor.Guard(model, optimizer, scaler)
    for batch in loader:
        guard.step(train_step, batch)

See docs/api.md. `watch` and the integrations build on the same hooks (`guard.hooks`).
NB: the names load on first use, so that a watched process, which needs only the hooks,
does not import the report assembly and the diagnosis rules at startup.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nandoctor.guard.api import ForecastWarning, Guard, NonFiniteError

__all__ = ["ForecastWarning", "Guard", "NonFiniteError"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        # NB: with Python's `random` state kept: importing rich draws from it
        # (rich/style.py), and the user seeded it before building the guard
        state = random.getstate()
        try:
            from nandoctor.guard import api
        finally:
            random.setstate(state)
        return getattr(api, name)
    raise AttributeError(f"module 'nandoctor.guard' has no attribute {name!r}")
