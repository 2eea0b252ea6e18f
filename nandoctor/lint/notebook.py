"""Jupyter notebooks as lint input: the code cells joined into one module, and a map back.

    nb = read_notebook(Path("explore.ipynb"))
    nb.text                 # every code cell, in order, as one Python module
    nb.where(41)            # (3, 12): line 41 of the module is line 12 of cell 3

The cells are linted together because a notebook runs as one namespace: the imports of
cell 1 hold in cell 7. Cells are numbered from 1 in notebook order, markdown cells
included, as Jupyter and VS Code show them. IPython syntax is not Python: a line magic
(`%matplotlib inline`), a shell line (`!pip install torch`, `x = !ls`) and a help line
(`torch.log?`) become `pass` at the same indentation (so a block stays a block and line
numbers stay put); a cell magic (`%%bash`, `%%time`) makes its whole cell invisible to
the checks, since its body may be another language.

A cell that is not valid Python on its own (Jupyter compiles each cell apart, so it
would raise SyntaxError when run) is left out of the module and named in `errors`: one
half-written cell does not hide what the other cells hold.

Where each line is written in the `.ipynb` file itself (`Notebook.in_file`) is known for
the usual layout (each cell's `source` a list of JSON strings, or one string, as Jupyter,
VS Code and nbformat write it): SARIF's regions count in the file, not in the cell.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

from nandoctor.lint.findings import syntax_reason

SUFFIX = ".ipynb"

_IPYTHON_LINE = re.compile(r"^(\s*)(?:[%!]|\w+\s*=\s*[%!])")
_HELP_LINE = re.compile(r"^(\s*)[\w.]+\?{1,2}\s*$")
_SOURCE_KEY = re.compile(r'"source"\s*:')


class NotebookError(ValueError):
    """The file is not a notebook nandoctor can read (not JSON, no `cells` list)."""


@dataclass(frozen=True)
class CellError:
    """A code cell left out of the module: its source does not parse."""

    cell: int  # 1-based, markdown cells counted
    line: int | None  # in the cell
    column: int | None
    message: str


@dataclass(frozen=True)
class Notebook:
    text: str  # the code cells as one module
    cells: tuple[int, ...]  # per line of `text`: the cell it came from (1-based)
    lines: tuple[int, ...]  # per line of `text`: its line inside that cell (1-based)
    originals: tuple[str, ...]  # per line of `text`: the line as the user wrote it
    errors: tuple[CellError, ...] = ()
    # per line of `text`: where that line is written in the .ipynb file, as the offset of
    # its JSON string's opening quote and the line's start inside the decoded string
    # (None where the file's layout is not the usual one; see `in_file`)
    anchors: tuple[tuple[int, str, int] | None, ...] = ()
    raw: str = ""  # the file's text
    # per line of `text`: the indentation taken off it (an indented cell is dedented)
    shifts: tuple[int, ...] = ()

    def where(self, line: int) -> tuple[int, int]:
        """(cell, line in cell) for a 1-based line of `text`."""
        i = min(max(line, 1), len(self.cells)) - 1
        return (self.cells[i], self.lines[i]) if self.cells else (1, line)

    def column(self, line: int, column: int) -> int:
        """A 1-based column of `text`'s line, counted in the line as the user wrote it."""
        return column + (self.shifts[line - 1] if 0 < line <= len(self.shifts) else 0)

    def original(self, line: int) -> str:
        return self.originals[line - 1] if 0 < line <= len(self.originals) else ""

    def in_file(self, line: int, column: int) -> tuple[int, int] | None:
        """(line, column), both 1-based, in the .ipynb file of a 1-based line and column of
        `text`; None when the file's layout hides it."""
        anchor = self.anchors[line - 1] if 0 < line <= len(self.anchors) else None
        if anchor is None:
            return None
        quote, string, start = anchor
        line_end = string.find("\n", start)
        stop = min(start + max(column, 1) - 1, len(string) if line_end < 0 else line_end)
        # NB: the characters as the file encodes them (escapes, \uXXXX), from the quote
        at = quote + len(_encoded(string[:stop], self.raw, quote)) - 1
        row_start = self.raw.rfind("\n", 0, at) + 1
        return self.raw.count("\n", 0, at) + 1, at - row_start + 1


def is_notebook(path: Path) -> bool:
    return path.suffix.lower() == SUFFIX


def read_notebook(path: Path) -> Notebook:
    """Raises `NotebookError` (and OSError) for a file that is not a readable notebook."""
    try:
        raw = path.read_text(encoding="utf-8")
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotebookError(f"not a notebook (invalid JSON: {e})") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise NotebookError("not a notebook (no `cells` list)")
    return parse_cells(cells, raw)


def parse_cells(cells: list[object], raw: str = "") -> Notebook:
    """`raw`: the file's text, to place lines in it (`Notebook.in_file`)."""
    text: list[str] = []
    where_cell: list[int] = []
    where_line: list[int] = []
    originals: list[str] = []
    errors: list[CellError] = []
    anchors: list[tuple[int, str, int] | None] = []
    shifts: list[int] = []
    strings = _StringFinder(raw)
    for number, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict):
            continue
        source = cell.get("source", "")
        parts = [str(x) for x in source] if isinstance(source, list) else [str(source)]
        lines = "".join(parts).splitlines() or [""]
        placed = strings.anchors(parts, len(lines))  # NB: every cell's, to keep the order
        if cell.get("cell_type") != "code":
            continue
        magic_cell = lines[0].lstrip().startswith("%%")
        code = [""] * len(lines) if magic_cell else python_lines(lines)
        error = _syntax_error(number, code)
        if error is not None:
            errors.append(error)
            code = [""] * len(lines)
        text.extend(code)
        where_cell.extend([number] * len(lines))
        where_line.extend(range(1, len(lines) + 1))
        originals.extend(lines)
        anchors.extend(placed)
        shifts.extend(_shifts(lines))
    return Notebook(
        "\n".join(text) + "\n",
        tuple(where_cell),
        tuple(where_line),
        tuple(originals),
        tuple(errors),
        tuple(anchors),
        raw,
        tuple(shifts),
    )


def _shifts(lines: list[str]) -> list[int]:
    """The indentation `python_lines` takes off each line of a cell (its first line's)."""
    indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())]
    return [len(indent) if indent and line.startswith(indent) else 0 for line in lines]


def _syntax_error(cell: int, code: list[str]) -> CellError | None:
    try:
        ast.parse("\n".join(code) + "\n")
    except SyntaxError as e:
        return CellError(cell, e.lineno, e.offset, syntax_reason(e.msg))
    except (ValueError, RecursionError, MemoryError) as e:  # NB: a NUL byte, deep nesting
        return CellError(cell, None, None, f"cannot parse: {e}")
    return None


class _StringFinder:
    """Finds each cell's source strings in the file's text, cell after cell, each after its
    cell's `"source":` key (NB: not in its outputs, which writers put before it)."""

    def __init__(self, raw: str) -> None:
        self.raw, self.at = raw, 0

    def anchors(self, parts: list[str], n_lines: int) -> list[tuple[int, str, int] | None]:
        key = _SOURCE_KEY.search(self.raw, self.at)
        if key is None:
            return [None] * n_lines
        self.at = key.end()
        after = _SOURCE_KEY.search(self.raw, self.at)
        end = after.start() if after is not None else len(self.raw)  # NB: not the next cell's
        found: list[tuple[int, str, int] | None] = []
        for part in parts:
            quote = self._find(part, end)
            starts = [0] + [i + 1 for i, c in enumerate(part) if c == "\n" and i + 1 < len(part)]
            found.extend(None if quote is None else (quote, part, s) for s in starts)
        # NB: a layout the finder does not know is left unplaced, never misplaced
        return found if len(found) == n_lines and None not in found else [None] * n_lines

    def _find(self, part: str, end: int) -> int | None:
        for ascii_only in (False, True):
            at = self.raw.find(json.dumps(part, ensure_ascii=ascii_only), self.at, end)
            if at >= 0:
                self.at = at + 1
                return at
        return None


def _encoded(prefix: str, raw: str, quote: int) -> str:
    """`prefix` as the file wrote it (with or without \\uXXXX escapes for non-ASCII)."""
    as_is = json.dumps(prefix, ensure_ascii=False)
    return as_is if raw.startswith(as_is[:-1], quote) else json.dumps(prefix)


def python_lines(lines: list[str]) -> list[str]:
    """A code cell's lines as Python, one for one, as IPython reads them: a cell whose
    first line is indented has that indentation taken off every line; an IPython line
    becomes `pass`, and the lines it continues onto with a trailing backslash
    (`!pip install -q \\`) become blank."""
    indent = lines[0][: len(lines[0]) - len(lines[0].lstrip())] if lines else ""
    out: list[str] = []
    continued = False
    for line in lines:
        if indent and line.startswith(indent):
            line = line[len(indent) :]
        if continued:
            out.append("")
        else:
            out.append(python_line(line))
            if out[-1] == line:  # NB: Python: its own continuations are Python's
                continue
        continued = line.rstrip().endswith("\\")
    return out


def python_line(line: str) -> str:
    """The line itself, or `pass` at its indentation when it is IPython syntax."""
    match = _IPYTHON_LINE.match(line) or _HELP_LINE.match(line)
    return f"{match.group(1)}pass" if match else line
