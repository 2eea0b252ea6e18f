"""`Registry`: a table of named things that refuses a second thing under a name it holds.

The cause catalog, the rules, the fix plans, the config changes a what-if can make, the math
patches and the lint checks all register through it, so a copy-pasted module that forgets to
change its id fails at import, naming both places, instead of silently replacing the first
(the ranking and the generated docs would then quietly lose a cause).

It sits at the top of the package, below every layer, because its users span them: the math
patches (runtime) may not import the causes, the lint checks (lint) may. Nothing here
imports anything of nandoctor.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class DuplicateError(ValueError):
    """A second registration under a name the registry already holds."""


class Registry(dict[str, T]):
    """A dict in registration order whose `add` refuses duplicates.

    `kind` names what it holds ("rule", "math patch") for the error messages; `add` records
    who registered each entry (`by`, a module or class name) so that a duplicate names both.
    Plain item assignment stays possible on purpose: tests swap an entry with
    `monkeypatch.setitem` and pytest restores it.
    """

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self._by: dict[str, str] = {}

    def add(self, name: str, item: T, by: str) -> T:
        """Register `item` under `name`; a name registered before raises `DuplicateError`."""
        if name in self:
            raise DuplicateError(
                f"{self.kind} {name!r} is registered twice: first by {self._by.get(name, '?')}, "
                f"again by {by}; one {self.kind} per name"
            )
        self[name] = item
        self._by[name] = by
        return item

    def registered_by(self, name: str) -> str:
        """Who registered `name` (a module or class name)."""
        return self._by[name]
