"""kvfsd's layers as kvfsd/caches.py's docstring states them: `Caches` builds its helpers
(recovery, policy, expiry, migration) and hands each only the functions and state it
uses, so no helper imports kvfsd.caches — not even under TYPE_CHECKING or inside a
function (the whole project's graph has no cycle: tests/unit/test_import_graph.py)."""
from __future__ import annotations

import dataclasses

import pytest

from tests.unit.import_graph import graph, imports

HELPERS = ("kvfsd.recovery", "kvfsd.policy", "kvfsd.expiry", "kvfsd.migration")


def _graph() -> dict[str, set[str]]:
    return graph(("kvfsd",))


def test_the_graph_sees_every_kind_of_import():
    edges = _graph()
    assert set(HELPERS) <= set(edges)
    assert "kvfsd.caches" in edges["kvfsd.fs"]                  # top-level `from`
    assert "kvfsd.xattrs" in edges["kvfsd.namespace"]           # `from kvfsd import m`
    assert set(HELPERS) <= edges["kvfsd.caches"]
    # a hidden import (inside a function, under TYPE_CHECKING) is an edge like any other
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from kvfsd.caches import Caches\n"
              "def f():\n    import kvfsd.fs\n    from . import node\n"
              "class C:\n    from .xattrs import PIN\n")
    assert imports("kvfsd.probe", source, set(edges)) == \
        {"kvfsd.caches", "kvfsd.fs", "kvfsd.node", "kvfsd.xattrs"}


@pytest.mark.parametrize("helper", HELPERS)
def test_no_helper_imports_caches(helper):
    assert "kvfsd.caches" not in _graph()[helper]


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
