"""The package's import rules (docs/architecture.md, "Import rules"), read from the source:

- no import cycle between tarantella's modules (imports inside functions count: a lazy
  import only hides a cycle);
- no module imports another subpackage's underscore names: ``tarantella.X._y`` is private
  to ``tarantella.X`` and what lies inside it (``tarantella._core`` and the top-level
  private modules are the whole package's).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import tarantella


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package at ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (ancestor packages left out: they are being
    initialised whenever one of their modules runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = name.split(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
            targets = subs + ([module] if len(subs) < len(node.names) else [])
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t.split(".")[0] == top
                     and not name.startswith(t + ".") and t != name)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def private_reaches(graph: dict[str, set[str]], packages: set[str]) -> list[tuple[str, str]]:
    """(importer, imported) where ``imported`` is private to a package ``importer`` is not in."""
    bad = []
    for importer, targets in graph.items():
        own = importer if importer in packages else importer.rpartition(".")[0]
        for target in targets:
            parts = target.split(".")
            first = next((i for i, p in enumerate(parts) if p.startswith("_") and i > 0), None)
            if first is None:
                continue
            owner = ".".join(parts[:first])
            if not (own == owner or own.startswith(owner + ".")):
                bad.append((importer, target))
    return sorted(bad)


def _check(root: Path) -> tuple[list[list[str]], list[tuple[str, str]]]:
    graph = import_graph(root)
    packages = {n for n, p in _modules(root).items() if p.name == "__init__.py"}
    return cycles(graph), private_reaches(graph, packages)


def test_tarantella_has_no_import_cycle_and_no_private_reach_into_another_subpackage():
    root = Path(tarantella.__file__).parent
    graph = import_graph(root)
    assert len(graph) > 40 and "tarantella._core.mesh" in graph  # the walk sees the package
    found_cycles, reaches = _check(root)
    assert found_cycles == [], found_cycles
    assert reaches == [], reaches


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


def test_the_checks_find_a_lazy_cycle_and_a_reach_into_another_subpackage(tmp_path):
    root = _package(tmp_path, {
        "pkg/__init__.py": "from . import a, sub\n",
        "pkg/a.py": "from . import b\n",
        "pkg/b.py": "def f():\n    from . import a\n",           # lazy: still a cycle
        "pkg/_core/__init__.py": "",
        "pkg/_core/mesh.py": "",
        "pkg/sub/__init__.py": "from .._core import mesh\n",       # the shared core: allowed
        "pkg/sub/_own.py": "from ..other._private import x\n",   # another subpackage's: not
        "pkg/other/__init__.py": "",
        "pkg/other/_private.py": "x = 1\n",
    })
    found_cycles, reaches = _check(root)
    assert found_cycles == [["pkg.a", "pkg.b"]]
    assert reaches == [("pkg.sub._own", "pkg.other._private")]
