"""Which library function a name means: imports and aliases resolved to qualified names.

    import torch.nn.functional as F                  F.softmax -> torch.nn.functional.softmax
    from torch import log                            log       -> torch.log
    from torch.nn.functional import softmax as sm    sm        -> torch.nn.functional.softmax
    functional = torch.nn.functional                 functional.softmax -> (the same)
    import math; def log(x): ...                     math.log  -> math.log; log -> None

Checks compare qualified names, so an alias never hides a finding and a user's own `log`
(or `np.log`, `math.log`) never raises one. Scoping is approximate on purpose: imports
anywhere in the file count for the whole file, and a name bound locally (a parameter, an
assignment, a `def`) shadows them in its function.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# The names every tutorial and pasted snippet uses without showing its imports: a
# notebook cell or a loop copied from a post still means torch by `torch`, `nn` and `F`.
CONVENTIONAL = {"torch": "torch", "nn": "torch.nn", "F": "torch.nn.functional"}

# Qualified names whose value is +inf (`-math.inf` is how many scripts write -inf).
INF_NAMES = frozenset({"math.inf", "numpy.inf", "numpy.Inf", "numpy.infty", "torch.inf"})


@dataclass(frozen=True)
class Imports:
    """Local name -> qualified name, for the whole file."""

    aliases: Mapping[str, str]
    star_modules: tuple[str, ...]  # `from torch import *`: bare names may come from here

    def resolve_global(self, name: str) -> str | None:
        if name in self.aliases:
            return self.aliases[name]
        for module in self.star_modules:
            if module == "torch" or module.startswith("torch."):
                return f"{module}.{name}"
        return None


def collect_imports(nodes: Iterable[ast.AST]) -> Imports:
    """From every node of a file (imports anywhere count for the whole file)."""
    nodes = list(nodes)
    aliases: dict[str, str] = {}
    stars: list[str] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if alias.name == "*":
                    stars.append(node.module)
                else:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    _add_assigned_aliases(nodes, aliases)
    return Imports(aliases=aliases, star_modules=tuple(stars))


def with_conventional(imports: Imports, used: Iterable[str]) -> Imports:
    """`imports` plus `CONVENTIONAL` names the file uses but never imports or binds itself
    at module level (`used` are such names); an import of its own always wins."""
    extra = {n: CONVENTIONAL[n] for n in used if n in CONVENTIONAL and n not in imports.aliases}
    if not extra:
        return imports
    return Imports(aliases={**imports.aliases, **extra}, star_modules=imports.star_modules)


def _add_assigned_aliases(nodes: list[ast.AST], aliases: dict[str, str]) -> None:
    """`F = torch.nn.functional` works like an import when the right side is a dotted
    name that resolves (one pass, in file order, is enough for real scripts)."""
    for node in nodes:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Attribute):
            dotted = dotted_name(node.value)
            head = dotted.split(".")[0] if dotted else None
            if dotted and head in aliases and head != target.id:
                aliases[target.id] = aliases[head] + dotted[len(head) :]


def alias_targets(assignments: Iterable[ast.AST], imports: Imports) -> frozenset[str]:
    """Names bound by an alias assignment; they are not local variables."""
    return frozenset(
        n.targets[0].id
        for n in assignments
        if isinstance(n, ast.Assign)
        and len(n.targets) == 1
        and isinstance(n.targets[0], ast.Name)
        and n.targets[0].id in imports.aliases
        and isinstance(n.value, ast.Attribute)
    )


def dotted_name(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of attributes on a name, else None (calls, subscripts...)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))
