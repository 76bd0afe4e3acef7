"""docs/architecture.md names the functions a request goes through; the walk must be true.

Every `path.py:name` the page names must exist. In the walk ("One request, hop by hop"),
`A` → `B` says that A calls B, and `A` → `B`, `C` that A calls each: the test finds B's
name used in A's body and, for a function, B's module is A's or one A's module imports
(itself or through a module that re-exports B: a facade). A method is called on an object
whose class no static reading knows (an engine behind its Protocol), so for a method the
name is what is checked. `A` ⇢ `B` is a hop between processes through Redis, which no
call can show: both ends must exist.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
# `path/to/file.py:name` or `path/to/file.py:Class.method`
REFERENCE = re.compile(r"`([\w/]+\.py):([A-Za-z_][\w.]*)`")
CALL, PROCESS_HOP = "→", "⇢"


@cache
def _definitions(path: Path) -> dict[str, ast.AST]:
    """Top-level functions and classes, and Class.method for each method."""
    found: dict[str, ast.AST] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            found |= {f"{node.name}.{item.name}": item for item in node.body
                      if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}
    return found


def _module(file: str) -> str:
    return file.removesuffix(".py").replace("/", ".")


@cache
def _imported_modules(file: str) -> frozenset[str]:
    """The modules `file` imports, and those it imports names from."""
    modules = set()
    for node in ast.walk(ast.parse((ROOT / file).read_text())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    return frozenset(modules)


def _reachable(caller_file: str, callee_file: str) -> bool:
    """Whether code in `caller_file` can name what `callee_file` defines: the same module,
    imported, or re-exported by a first-party module it imports."""
    callee = _module(callee_file)
    imported = _imported_modules(caller_file)
    if callee_file == caller_file or callee in imported:
        return True
    return any(callee in _imported_modules(file) for file in (
        f"{module.replace('.', '/')}.py" for module in imported) if (ROOT / file).is_file())


def _calls(caller: tuple[str, str], callee: tuple[str, str]) -> bool:
    """Whether the caller's body names the callee, from a module it can reach it through."""
    (caller_file, caller_name), (callee_file, callee_name) = caller, callee
    body = _definitions(ROOT / caller_file)[caller_name]
    short = callee_name.split(".")[-1]
    named = any(isinstance(node, ast.Name) and node.id == short
                or isinstance(node, ast.Attribute) and node.attr == short
                for node in ast.walk(body))
    is_method = "." in callee_name
    return named and (is_method or _reachable(caller_file, callee_file))


def _walk() -> str:
    text = DOC.read_text()
    start = text.index("### One request, hop by hop")
    return " ".join(text[start:text.index("\n### ", start + 1)].split())


def _hops(walk: str) -> tuple[list[tuple[tuple[str, str], tuple[str, str]]], list, set]:
    """The walk's calls and process hops, and the references on neither."""
    calls, process_hops, alone = [], [], set()
    refs = list(REFERENCE.finditer(walk))
    caller = None
    for before, after in zip(refs, refs[1:], strict=False):
        between = walk[before.end():after.start()].strip()
        a, b = (before.group(1), before.group(2)), (after.group(1), after.group(2))
        if between == CALL:
            calls.append((a, b))
            caller = a
        elif between == "," and caller is not None:
            calls.append((caller, b))
        else:
            caller = None
            if between == PROCESS_HOP:
                process_hops.append((a, b))
    joined = {ref for pair in calls + process_hops for ref in pair}
    alone = {(m.group(1), m.group(2)) for m in refs} - joined
    return calls, process_hops, alone


def test_every_function_the_architecture_names_exists():
    missing = [f"{file}:{name}" for file, name in REFERENCE.findall(DOC.read_text())
               if not (ROOT / file).is_file() or name not in _definitions(ROOT / file)]
    assert missing == []


def test_each_call_of_the_walk_is_made():
    calls, _, _ = _hops(_walk())
    assert calls, "the walk has no `A` → `B` hops"
    not_made = [f"{a[0]}:{a[1]} → {b[0]}:{b[1]}" for a, b in calls if not _calls(a, b)]
    assert not_made == []


def test_every_function_of_the_walk_is_on_a_hop():
    _, process_hops, alone = _hops(_walk())
    assert process_hops, "the walk crosses no process"
    assert sorted(f"{file}:{name}" for file, name in alone) == []


def test_a_call_the_code_does_not_make_is_caught():
    walk = ("`inference/views.py:chat_completions` → `inference/pipeline.py:Run.start`, "
            "`engine/worker.py:Worker.tick`")
    calls, _, _ = _hops(walk)
    assert [_calls(a, b) for a, b in calls] == [False, False]
