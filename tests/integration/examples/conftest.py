"""The `example` fixture: a program of mount_examples/ imported for its helpers."""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from tests.integration.examples_fixtures import load_example


@pytest.fixture
def example(monkeypatch) -> Callable[[str], ModuleType]:
    """example("rag_cache"): mount_examples/rag_cache.py as a module, for this test."""
    return lambda name: load_example(name, monkeypatch)
