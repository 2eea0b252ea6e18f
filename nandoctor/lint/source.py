"""One parsed file and the facts that checks ask about, each computed once, on demand.

A check receives a `Source` and asks: what does this name resolve to (`qualname`), which
function is this node in (`scope_of`), which nodes enclose it (`ancestors`), where is it
for the user (`span`). Facts that the analysis modules compute from a whole file (what a
variable holds: `flow.flow_of`; which code is differentiated: `grad`) are kept here too,
by `analysis`: the `Source` holds every cache of its file, and dies with them.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar, cast, overload

from nandoctor.lint.index import Index, Located, build_index
from nandoctor.lint.names import (
    CONVENTIONAL,
    Imports,
    alias_targets,
    collect_imports,
    with_conventional,
)

T = TypeVar("T")
A = TypeVar("A", bound=ast.AST)
B = TypeVar("B", bound=ast.AST)
C = TypeVar("C", bound=ast.AST)
D = TypeVar("D", bound=ast.AST)

_MENTIONS_TORCH = re.compile(r"\btorch\b|\b(?:nn|F)\.")


@dataclass(frozen=True)
class Span:
    """1-based lines and character columns; `end_column` is exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int


class Source:
    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.text = text
        with warnings.catch_warnings():  # NB: "\d" in a user's string is not our business
            warnings.simplefilter("ignore")
            self.tree = ast.parse(text, filename=path)  # NB: SyntaxError is the caller's
        self.lines = re.split(r"\r\n|\r|\n", text)  # NB: not splitlines(): \f is no newline
        self._qualnames: dict[ast.AST, str | None] = {}
        self._analyses: dict[Callable[[Source], object], object] = {}

    def analysis(self, compute: Callable[[Source], T]) -> T:
        """`compute(self)`, computed once for this file: a fact of the whole file that a
        module of lint defines (`Flow`, the differentiated functions, the GradScaler's
        uses) and several checks ask for. The module says how; the `Source` keeps it."""
        if compute not in self._analyses:
            self._analyses[compute] = compute(self)
        return cast(T, self._analyses[compute])

    @cached_property
    def _index(self) -> Index:
        return build_index(self.tree)

    @property
    def nodes(self) -> list[ast.AST]:
        """Every node, in pre-order (NB: one walk; a walk of a big file costs more than a
        check)."""
        return self._index.nodes

    @property
    def parents(self) -> dict[ast.AST, tuple[ast.AST, str]]:
        """Each node's parent and the field of the parent that holds it."""
        return self._index.parents

    @cached_property
    def _by_type(self) -> dict[type, list[ast.AST]]:
        by_type: dict[type, list[ast.AST]] = {}
        for node in self.nodes:
            by_type.setdefault(type(node), []).append(node)
        return by_type

    @overload
    def nodes_of(self, a: type[A], /) -> list[A]: ...
    @overload
    def nodes_of(self, a: type[A], b: type[B], /) -> list[A | B]: ...
    @overload
    def nodes_of(self, a: type[A], b: type[B], c: type[C], /) -> list[A | B | C]: ...
    @overload
    def nodes_of(
        self, a: type[A], b: type[B], c: type[C], d: type[D], /
    ) -> list[A | B | C | D]: ...

    def nodes_of(self, *types: type[ast.AST]) -> list[Any]:
        """The nodes of these types, in pre-order, typed as what they are: `nodes_of(ast.Assign,
        ast.AugAssign)` is a `list[ast.Assign | ast.AugAssign]` (shared: do not change it)."""
        if len(types) == 1:
            return self._by_type.get(types[0], [])
        return [n for n in self.nodes if isinstance(n, types)]

    @cached_property
    def calls(self) -> list[ast.Call]:
        """Every call, in source order."""
        return sorted(self.nodes_of(ast.Call), key=position)

    @cached_property
    def calls_by_function(self) -> dict[ast.AST, list[ast.Call]]:
        """Calls grouped by their innermost function (the module for top-level code)."""
        groups: dict[ast.AST, list[ast.Call]] = {}
        for call in self.calls:
            groups.setdefault(self.function_of(call) or self.tree, []).append(call)
        return groups

    @cached_property
    def imports(self) -> Imports:
        """The file's imports, plus `torch`, `nn` and `F` when a snippet uses them unimported
        (a module-level binding of its own, `F = 3`, still shadows them)."""
        found = collect_imports(self.nodes)
        module_names = self._index.bindings.get(self.tree, frozenset())
        names = (n.id for n in self.nodes_of(ast.Name))
        used = {n for n in names if n in CONVENTIONAL and n not in module_names}
        return with_conventional(found, used)

    @cached_property
    def imports_torch(self) -> bool:
        """True when the file imports torch or uses its conventional names."""
        if not _MENTIONS_TORCH.search(self.text):
            return False  # NB: spares indexing files that cannot be about torch
        return any(q == "torch" or q.startswith("torch.") for q in self.imports.aliases.values())

    @cached_property
    def _alias_names(self) -> frozenset[str]:
        return alias_targets(self.nodes_of(ast.Assign), self.imports)

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parents:
            node = self.parents[node][0]
            yield node

    def statement_lines(self, node: Located) -> tuple[int, int]:
        """The lines of the statement `node` is part of, where a suppression comment may
        sit: a formatter puts it on the first or the closing line of a call it wrapped.
        Of a compound statement (`if`, `with`, `for`...), its header only, not its body."""
        statement = next(
            (a for a in [node, *self.ancestors(node)] if isinstance(a, ast.stmt)), None
        )
        if statement is None:
            return node.lineno, node.end_lineno or node.lineno
        body = getattr(statement, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            return statement.lineno, max(statement.lineno, body[0].lineno - 1)
        return statement.lineno, statement.end_lineno or statement.lineno

    def scope_of(self, node: ast.AST) -> ast.AST:
        """The innermost function, lambda, class body or module `node` is evaluated in."""
        return self._index.scopes.get(node, self.tree)

    def enclosing_scopes(self, node: ast.AST) -> Iterator[ast.AST]:
        scope = self.scope_of(node)
        while True:
            yield scope
            if scope is self.tree:
                return
            scope = self.scope_of(scope)

    def function_of(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The innermost `def` around `node` (lambdas and class bodies skipped)."""
        for scope in self.enclosing_scopes(node):
            if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return scope
        return None

    def class_of(self, node: ast.AST) -> ast.ClassDef | None:
        return next((s for s in self.enclosing_scopes(node) if isinstance(s, ast.ClassDef)), None)

    def bindings(self, scope: ast.AST) -> frozenset[str]:
        """Names that `scope` binds itself (parameters, assignments, defs; not imports)."""
        return self._bindings.get(scope, frozenset())

    @cached_property
    def _bindings(self) -> dict[ast.AST, frozenset[str]]:
        aliases = self._alias_names
        return {scope: names - aliases for scope, names in self._index.bindings.items()}

    def qualname(self, node: ast.AST) -> str | None:
        """`torch.nn.functional.softmax` for `F.softmax` after `import torch.nn.functional
        as F`; None for anything that is not an imported name (locals, calls, ...)."""
        if node not in self._qualnames:
            self._qualnames[node] = self._qualname(node)
        return self._qualnames[node]

    def _qualname(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        if not isinstance(node, ast.Name):
            return None
        for scope in self._visible_scopes(node):
            if node.id in self.bindings(scope):
                return None
        return self.imports.resolve_global(node.id)

    def _visible_scopes(self, node: ast.AST) -> Iterator[ast.AST]:
        """The enclosing functions, innermost first, then the module (class bodies are not
        visible from their methods)."""
        for i, scope in enumerate(self.enclosing_scopes(node)):
            if not isinstance(scope, ast.ClassDef) or i == 0:
                yield scope

    def exclusive(self, a: ast.AST, b: ast.AST) -> bool:
        """True when `a` and `b` sit in different branches of one `if` (never both run), or
        of two `if`s of one function with the same test (`if args.amp: scale ... else:
        backward`, then `if args.amp: unscale_, clip ... else: clip`: a flag set once)."""
        branches = {id(p): f for p, f in self._branches(a)}
        if any(id(p) in branches and branches[id(p)] != f for p, f in self._branches(b)):
            return True
        tests = {
            (ast.dump(p.test), f)
            for p, f in self._branches(a)
            if isinstance(p, ast.If) and self.scope_of(p) is self.scope_of(b)
        }
        return any(
            (ast.dump(p.test), other) in tests
            for p, f in self._branches(b)
            if isinstance(p, ast.If)
            for other in ("body", "orelse")
            if other != f
        )

    def _branches(self, node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
        while node in self.parents:
            parent, field = self.parents[node]
            if isinstance(parent, (ast.If, ast.IfExp)) and field in ("body", "orelse"):
                yield parent, field
            node = parent

    def span(self, node: Located) -> Span:
        line, end_line = node.lineno, node.end_lineno or node.lineno
        column = self._char_column(line, node.col_offset)
        end = self._char_column(end_line, node.end_col_offset or 0)
        return Span(line, column + 1, end_line, end + 1)

    def _char_column(self, line: int, byte_offset: int) -> int:
        """NB: `ast` columns count UTF-8 bytes; users and SARIF count characters."""
        text = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return len(text.encode("utf-8")[:byte_offset].decode("utf-8", errors="ignore"))

    def line_text(self, line: int) -> str:
        return self.lines[line - 1] if 0 < line <= len(self.lines) else ""

    def segment(self, node: ast.AST) -> str:
        """The node's source text, on one line (for messages and the checks' patterns).

        NB: cut from the lines split once, not `ast.get_source_segment`, which splits the
        whole text again at every call: checks ask for a segment per assignment, and a file
        of thousands of lines took minutes."""
        line, end_line = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
        if line is None or end_line is None or not 0 < line <= end_line <= len(self.lines):
            return " ".join(ast.unparse(node).split())
        rows = [t.encode("utf-8") for t in self.lines[line - 1 : end_line]]
        rows[-1] = rows[-1][: getattr(node, "end_col_offset", None)]
        rows[0] = rows[0][getattr(node, "col_offset", None) :]
        return " ".join(b" ".join(rows).decode("utf-8", errors="replace").split())


def position(node: ast.AST) -> tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))
