"""The packages' import graph, read from the source: no module imports itself back through
others (counting imports inside functions and under TYPE_CHECKING, which hide a cycle
but do not remove it), and every package opens with a docstring that says what it may
import."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("predd", "kvfsd", "liblip", "gatewayd", "symphony_protocol", "openai_lip")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project's modules `name` imports anywhere in its file (`from pkg import mod`
    counts as importing pkg.mod: its package is being initialised already)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]   # a module, or from its base
        else:
            continue
        for imported in names:
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                out.add(imported)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_no_module_imports_itself_back():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 100 and graph["predd.engine.core"]      # the graph was read
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_hidden_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


INITS = sorted(str(p.relative_to(ROOT)) for package in PACKAGES
               for p in (ROOT / package).rglob("__init__.py"))


@pytest.mark.parametrize("init", INITS)
def test_every_package_says_what_it_owns_and_may_import(init):
    doc = ast.get_docstring(ast.parse((ROOT / init).read_text()))
    assert doc and len(doc.split()) >= 10, f"{init} has no docstring saying what it owns"
    assert "May import:" in doc, f"{init} does not say what it may import"
