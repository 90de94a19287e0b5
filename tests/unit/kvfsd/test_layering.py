"""kvfsd's layers as kvfsd/caches.py's docstring states them: `Caches` builds its helpers
(recovery, policy, expiry, migration) and hands each only the functions and state it
uses, so no helper imports kvfsd.caches — not even under TYPE_CHECKING or inside a
function — and kvfsd's modules import one another without a cycle, seen or hidden."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import kvfsd

PACKAGE = Path(kvfsd.__file__).parent
HELPERS = ("kvfsd.recovery", "kvfsd.policy", "kvfsd.expiry", "kvfsd.migration")


def _modules() -> dict[str, Path]:
    """kvfsd's modules by dotted name (the package itself is `kvfsd`)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, source: str, known: set[str], is_package: bool = False) -> set[str]:
    """The kvfsd modules that module `name` (its `source`) imports anywhere: at the
    top, inside functions and classes, and under `if TYPE_CHECKING:` (ast.walk sees
    every one)."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                       # relative: from the package upwards
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from kvfsd import xattrs` imports the module kvfsd.xattrs
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            # `import kvfsd.a.b` loads kvfsd.a.b; count the deepest kvfsd module named
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path.read_text(), set(modules),
                           is_package=path.name == "__init__.py")
            for name, path in modules.items()}


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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_every_kind_of_import():
    graph = _graph()
    assert set(HELPERS) <= set(graph)
    assert "kvfsd.caches" in graph["kvfsd.fs"]                  # top-level `from`
    assert "kvfsd.xattrs" in graph["kvfsd.namespace"]           # `from kvfsd import m`
    assert set(HELPERS) <= graph["kvfsd.caches"]
    # a hidden import (inside a function, under TYPE_CHECKING) is an edge like any other
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from kvfsd.caches import Caches\n"
              "def f():\n    import kvfsd.fs\n    from . import node\n"
              "class C:\n    from .xattrs import PIN\n")
    assert _imports("kvfsd.probe", source, set(graph)) == \
        {"kvfsd.caches", "kvfsd.fs", "kvfsd.node", "kvfsd.xattrs"}


def test_a_cycle_is_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("helper", HELPERS)
def test_no_helper_imports_caches(helper):
    assert "kvfsd.caches" not in _graph()[helper]


def test_kvfsd_has_no_import_cycle():
    assert _cycles(_graph()) == []


def test_each_helper_is_given_its_ports_not_caches_or_another_helper(tmp_path):
    """At run time too: nothing a helper holds, nor any field of its ports, is the
    `Caches` or another helper (their functions are passed, never the objects)."""
    from kvfsd.caches import Caches
    from kvfsd.expiry import Expiry
    from kvfsd.migration import Migration
    from kvfsd.namespace import Namespace
    from kvfsd.policy import Policy
    from kvfsd.recovery import Recovery
    from kvfsd.replicas import Replicas
    from kvfsd.state import StateDir

    replicas = Replicas(["ipc:///run/a.sock", "ipc:///run/b.sock"], log=lambda line: None)
    caches = Caches(Namespace(), StateDir(str(tmp_path / "state")), replicas, print)
    forbidden = (Caches, Recovery, Policy, Expiry, Migration)
    helpers = [caches.policy, caches.expiry, caches.migration, *caches.recoveries.values()]
    assert len(caches.recoveries) == 2
    for helper in helpers:
        held = list(vars(helper).values())
        ports = helper.ports
        assert dataclasses.is_dataclass(ports) and ports.__dataclass_params__.frozen
        held += [getattr(ports, field.name) for field in dataclasses.fields(ports)]
        for value in held:
            values = list(value.values()) if isinstance(value, dict) else [value]
            assert not any(isinstance(v, forbidden) for v in values), (helper, value)
