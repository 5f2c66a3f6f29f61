"""The import graph of our packages (module-level and in-function imports alike) has no circles, except the
ones listed here, which are known and shrink as they are untangled (issue 20)."""

from __future__ import annotations

import ast
import time
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("actor", "broker", "common", "env_server", "launch", "learner", "policy")
KNOWN_CYCLES: set[frozenset[str]] = set()


def _parse(path: Path) -> ast.Module:
    """``ast.parse``, again when CPython 3.11's AST converter tripped over another thread's conversion: it keeps its
    recursion depth per interpreter, not per thread (gh-106905), and 3.11 formats every traceback through
    ``ast.parse``, so any thread of the test process logging an exception at that moment fails this test. The retry
    runs after the other conversion ended; any other error is raised."""
    for attempt in range(5):
        try:
            return ast.parse(path.read_text())
        except SystemError as exc:
            if "recursion depth mismatch" not in str(exc) or attempt == 4:
                raise
            time.sleep(0.1)
    raise RuntimeError(f"{path}: not parsed")  # (the loop returns or raises: a type checker's end)


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    mods = {_module(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(_parse(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            graph[mod].update(n for n in names if n in mods and n != mod)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_a_planted_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_no_import_circles_beyond_the_known_ones():
    found = {frozenset(c) for c in cycles(import_graph())}
    assert found <= KNOWN_CYCLES, sorted(sorted(c) for c in found - KNOWN_CYCLES)


FLOORS = {"common": 0, "env_server": 1, "broker": 2, "policy": 2, "actor": 3, "learner": 3, "launch": 4}
"""each package imports only from floors below its own (the house in docs/architecture.md)"""


def test_every_arrow_between_packages_runs_down_the_floors():
    up = sorted((m, d) for m, deps in import_graph().items() for d in deps
                if m.split(".")[0] != d.split(".")[0] and FLOORS[d.split(".")[0]] >= FLOORS[m.split(".")[0]])
    assert not up, f"imports that run up or sideways: {up}"


def test_the_ground_floor_loads_no_torch():
    """common/ holds no model code: no module of it imports torch or transformers when it is imported (the
    TensorBoard sink imports torch's writer inside the function that opens it)."""
    heavy = []
    for path in sorted((REPO / "common").rglob("*.py")):
        for node in _parse(path).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            heavy += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ("torch", "transformers")]
    assert not heavy, heavy
