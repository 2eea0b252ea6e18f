"""The report is plain data at the bottom of the package: no torch, nothing above it.

Renderers, CI and other people's tools read reports without loading torch, and the
engines depend on the report types, never the other way round.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import nandoctor.report

REPORT = Path(nandoctor.report.__file__).resolve().parent
ALLOWED = ("nandoctor.report", "nandoctor.errors", "nandoctor.version")


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_report_imports_nothing_above_it():
    above = {
        f"{path.name}: {name}"
        for path in REPORT.glob("*.py")
        for name in imported(path)
        if name.split(".")[0] == "nandoctor" and not name.startswith(ALLOWED)
    }
    assert not above


def test_the_report_loads_without_torch():
    modules = [f"nandoctor.report.{p.stem}" for p in REPORT.glob("*.py") if p.stem != "__init__"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
