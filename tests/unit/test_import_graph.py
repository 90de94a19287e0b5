"""The packages' import graph, read from the source (tests/unit/import_graph.py): no
module imports itself back through others (counting imports inside functions and under
TYPE_CHECKING, which hide a cycle but do not remove it), and every package opens with a
docstring that says what it may import."""
from __future__ import annotations

import ast

import pytest

from tests.unit.import_graph import PACKAGES, ROOT, cycles, graph, imports


def test_no_module_imports_itself_back():
    edges = graph()
    assert len(edges) > 100 and edges["predd.engine.core"]      # the graph was read
    assert cycles(edges) == []


def test_the_graph_sees_every_kind_of_import():
    known = {"p", "p.a", "p.b", "p.c", "p.d"}
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from p.a import A\n"
              "def f():\n    import p.b.missing\n    from . import c\n"
              "class C:\n    from .d import D\n")
    assert imports("p.x", source, known) == {"p.a", "p.b", "p.c", "p.d"}
    assert imports("p", "from p import a, NAME\n", known, is_package=True) == {"p.a"}


def test_the_cycle_finder_finds_a_hidden_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


INITS = sorted(str(p.relative_to(ROOT)) for package in PACKAGES
               for p in (ROOT / package).rglob("__init__.py"))


@pytest.mark.parametrize("init", INITS)
def test_every_package_says_what_it_owns_and_may_import(init):
    doc = ast.get_docstring(ast.parse((ROOT / init).read_text()))
    assert doc and len(doc.split()) >= 10, f"{init} has no docstring saying what it owns"
    assert "May import:" in doc, f"{init} does not say what it may import"
