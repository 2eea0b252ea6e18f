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
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".ipynb"

_IPYTHON_LINE = re.compile(r"^(\s*)(?:[%!]|\w+\s*=\s*[%!])")
_HELP_LINE = re.compile(r"^(\s*)[\w.]+\?{1,2}\s*$")


class NotebookError(ValueError):
    """The file is not a notebook nandoctor can read (not JSON, no `cells` list)."""


@dataclass(frozen=True)
class Notebook:
    text: str  # the code cells as one module
    cells: tuple[int, ...]  # per line of `text`: the cell it came from (1-based)
    lines: tuple[int, ...]  # per line of `text`: its line inside that cell (1-based)
    originals: tuple[str, ...]  # per line of `text`: the line as the user wrote it

    def where(self, line: int) -> tuple[int, int]:
        """(cell, line in cell) for a 1-based line of `text`."""
        i = min(max(line, 1), len(self.cells)) - 1
        return (self.cells[i], self.lines[i]) if self.cells else (1, line)

    def original(self, line: int) -> str:
        return self.originals[line - 1] if 0 < line <= len(self.originals) else ""


def is_notebook(path: Path) -> bool:
    return path.suffix.lower() == SUFFIX


def read_notebook(path: Path) -> Notebook:
    """Raises `NotebookError` (and OSError) for a file that is not a readable notebook."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotebookError(f"not a notebook (invalid JSON: {e})") from None
    cells = data.get("cells") if isinstance(data, dict) else None
    if not isinstance(cells, list):
        raise NotebookError("not a notebook (no `cells` list)")
    return parse_cells(cells)


def parse_cells(cells: list[object]) -> Notebook:
    text: list[str] = []
    where_cell: list[int] = []
    where_line: list[int] = []
    originals: list[str] = []
    for number, cell in enumerate(cells, start=1):
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        body = "".join(source) if isinstance(source, list) else str(source)
        lines = body.splitlines() or [""]
        magic_cell = lines[0].lstrip().startswith("%%")
        for i, line in enumerate(lines, start=1):
            text.append("" if magic_cell else python_line(line))
            where_cell.append(number)
            where_line.append(i)
            originals.append(line)
    return Notebook("\n".join(text) + "\n", tuple(where_cell), tuple(where_line), tuple(originals))


def python_line(line: str) -> str:
    """The line itself, or `pass` at its indentation when it is IPython syntax."""
    match = _IPYTHON_LINE.match(line) or _HELP_LINE.match(line)
    return f"{match.group(1)}pass" if match else line
