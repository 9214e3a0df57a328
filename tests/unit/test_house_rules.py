"""The layout's rules, checked on the tree: no source file over 500 lines, at most 10 modules directly under
``freeride/``, and no import circle among the modules of ``freeride`` (``backends/`` and ``sidetasks/``
included, as ``freeride.backends`` and ``freeride.sidetasks``).

An import circle counts module-level imports only (those inside functions, and under ``if TYPE_CHECKING:``,
run later or never); ``from package import name`` counts as an import of the submodule ``package.name``
where there is one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from test_package_names import ROOT, _sources

MAX_LINES = 500
MAX_TOP_MODULES = 10
PACKAGES = {"freeride": "freeride", "backends": "freeride.backends", "sidetasks": "freeride.sidetasks"}
"""Folder -> the import package it installs as."""


def _modules() -> dict[str, Path]:
    modules = {}
    for path in _sources():
        folder, *parts = path.relative_to(ROOT).with_suffix("").parts
        if folder in PACKAGES:
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((PACKAGES[folder], *parts))] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _top_level_imports(node.body)
            yield from _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level_imports(block)
        elif isinstance(node, ast.With):
            yield from _top_level_imports(node.body)


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (at ``path``) imports when it is imported."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _top_level_imports(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules:  # a name in a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_source_file_is_over_500_lines() -> None:
    long = {}
    for path in _sources():
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            long[str(path.relative_to(ROOT))] = lines
    assert long == {}, f"split these by a seam of their own: {long}"


def test_at_most_ten_modules_stand_directly_under_freeride() -> None:
    top = sorted(p.name for p in (ROOT / "freeride").glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, top


def test_no_import_circle_among_the_packages_modules() -> None:
    modules = _modules()
    assert "freeride.serve.scheduler" in modules and "freeride.backends.rank" in modules
    graph = {name: _imported(name, path, modules) for name, path in modules.items()}
    assert "freeride.serve.turns" in graph["freeride.serve.scheduler"]  # what the walk sees, checked once
    assert _circles(graph) == []


def test_the_circle_finder_finds_a_circle_and_only_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
