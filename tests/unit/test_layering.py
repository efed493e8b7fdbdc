"""The layers of the code base: `engine/` imports nothing of `server/`, `training/`, `bench/`,
`tests/` or `tools/`, and the modules of `engine/`, `server/` and `training/` import each other
without a cycle.

Imports are read from the source (ast), wherever they are in a module, function-level imports
included; only those under ``if TYPE_CHECKING:`` are left out, as they never run. ``from a
import b`` counts as an import of module ``a.b`` when that is a module, else of ``a``; an import
of ``a.b`` is not counted as one of its parent package ``a`` (whose ``__init__`` runs first), so
a package's ``__init__`` may re-export its submodules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "server", "training")
"""The project's packages whose modules must not import each other in a cycle."""
ABOVE_ENGINE = ("server", "training", "bench", "tests", "tools")
"""Top-level packages `engine/` must not import."""


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> source file, for every module of `packages` under `root`."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, except in the body of ``if TYPE_CHECKING:`` (its
    ``else:`` runs, so it counts)."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
        return
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children: list[ast.AST] = list(node.orelse)
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from _import_nodes(child)


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The absolute names `module` (source `path`) imports; a name of `known` when the import
    resolves to one of them."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join([*anchor, base] if base else anchor)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            names.add(submodule if submodule in known else base)
    return names


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (itself left out)."""
    files = module_files(root, packages)
    known = set(files)
    return {
        module: {name for name in imported_modules(module, path, known) if name in known} - {module}
        for module, path in files.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated last) per strongly connected component
    of more than one module, found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, component) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first (sorted) module of a strongly connected `component`."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def test_engine_imports_no_upper_layer() -> None:
    files = module_files(REPO, ("engine",))
    offenders = [
        f"{module} imports {name}"
        for module, path in files.items()
        for name in sorted(imported_modules(module, path, set(files)))
        if name.split(".")[0] in ABOVE_ENGINE
    ]
    assert not offenders, "engine/ must not import these layers:\n" + "\n".join(offenders)


def test_no_import_cycle() -> None:
    found = cycles(import_graph(REPO, PACKAGES))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_see_lazy_and_relative_imports_but_not_type_checking_ones(
    tmp_path: Path,
) -> None:
    _write(
        tmp_path,
        {
            "engine/__init__.py": "",
            "engine/a.py": "def f():\n    from engine import b\n",
            "engine/b.py": "from .c import X\n",
            "engine/c.py": "import engine.a\nX = 1\n",
            "engine/d.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from engine import e\n    import server.api\n"
                "else:\n    import json\n"
            ),
            "engine/e.py": "from engine import d\n",
            "engine/f.py": "class K:\n    def m(self):\n        import server.api\n",
            "engine/low/__init__.py": "",
            "engine/low/x.py": "from engine.high import y\n",
            "engine/high/__init__.py": "from engine.high.z import *\n",
            "engine/high/y.py": "",
            "engine/high/z.py": "from ..low.x import *\n",
            "server/__init__.py": "",
            "server/api.py": "from engine.a import f\n",
        },
    )
    graph = import_graph(tmp_path, ("engine", "server"))
    assert graph["engine.b"] == {"engine.c"}  # relative, `from x import NAME` -> x
    assert graph["engine.d"] == set()  # TYPE_CHECKING only; json is not a project module
    assert cycles(graph) == [["engine.a", "engine.b", "engine.c", "engine.a"]]
    assert graph["engine.high.z"] == {"engine.low.x"}  # `..` from a module of a subpackage
    assert graph["engine.high"] == {"engine.high.z"}  # `.` of a package's __init__ is itself
    files = module_files(tmp_path, ("engine",))
    assert "server.api" in imported_modules("engine.f", files["engine.f"], set(files))
