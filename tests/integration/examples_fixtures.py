"""Running the programs of mount_examples/ as real processes, and reading what they
report (`--report FILE`); importing one for its pure helpers (the `example` fixture,
tests/integration/examples/conftest.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
from types import ModuleType

import pytest

from tests.conftest import ROOT

EXAMPLES = os.path.join(ROOT, "mount_examples")
SIBLINGS = ("common",)      # the library modules of mount_examples/ programs import by name
LIP = os.path.join(os.path.dirname(sys.executable), "lip")


def example_env(**extra: str) -> dict:
    """The environment a LIP gets: PREDD_ADDR / KVFS_MOUNT as set by the fixtures, and
    the venv's `lip` first on PATH for the shell workflows."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return {**os.environ, "PATH": path, "LIP": LIP, **extra}


def run_example(name: str, *args: str, report: str | None = None, timeout: float = 240,
                cwd: str | None = None, env: dict | None = None
                ) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run mount_examples/NAME (a .py under this Python, a .sh under sh); its exit must be
    0. Returns the process and the JSON it wrote to `report`, if asked for one. `timeout`
    stays under the 300 s every test gets, so a hang reports which program hung."""
    path = os.path.join(EXAMPLES, name)
    argv = [sys.executable, path] if name.endswith(".py") else ["sh", path]
    argv += list(args) + (["--report", report] if report else [])
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          cwd=cwd or ROOT, env=env or example_env())
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    data = None
    if report:
        with open(report) as f:
            data = json.load(f)
    return proc, data


def load_example(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import mount_examples/NAME.py as the module NAME (for its pure helpers: tools,
    schema, documents), its sibling modules (SIBLINGS) loaded from there first, as
    `python NAME.py` would find them. They are in sys.modules (dataclasses need their
    module there) until `monkeypatch` undoes it at the end of the test."""
    for module_name in (*SIBLINGS, name):
        spec = importlib.util.spec_from_file_location(
            module_name, os.path.join(EXAMPLES, f"{module_name}.py"))
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, module_name, module)
        spec.loader.exec_module(module)
    return module


class LineReader:
    """Lines of a pipe, read on a thread, so a test can wait for one with a timeout."""

    def __init__(self, stream) -> None:
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, text: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no line with {text!r} in {timeout}s; saw {self.seen}")
            if line is None:
                raise AssertionError(f"stream ended before {text!r}; saw {self.seen}")
            self.seen.append(line)
            if text in line:
                return line
