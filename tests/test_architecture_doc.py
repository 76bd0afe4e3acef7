"""docs/architecture.md names a function at each hop of a request; each must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
# `path/to/file.py:name` or `path/to/file.py:Class.method`
REFERENCE = re.compile(r"`([\w/]+\.py):([A-Za-z_][\w.]*)`")


def _defined(path: Path) -> set[str]:
    """Top-level functions and classes, and Class.method for each method."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names |= {f"{node.name}.{item.name}" for item in node.body
                      if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}
    return names


def test_the_request_walk_names_many_hops():
    assert len(REFERENCE.findall(DOC.read_text())) >= 20


def test_every_function_the_architecture_names_exists():
    missing = [f"{file}:{name}" for file, name in REFERENCE.findall(DOC.read_text())
               if not (ROOT / file).is_file() or name not in _defined(ROOT / file)]
    assert missing == []
