"""Shared fixtures: a real predd (real model) per test session, and an integrity check
(`fsck`) after every test that used it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Daemon:
    proc: subprocess.Popen
    addr: str
    rundir: str
    log: str

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def die_with_parent() -> None:
    """preexec_fn: the daemon gets SIGTERM if the test process dies (no orphans)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def start_predd(rundir: str, *args: str, env: dict | None = None,
                timeout: float = 120.0) -> Daemon:
    """Start `python -m predd` and wait for its `ready <addr>` line. float32 unless the
    caller names a dtype: tests compare with transformers' float32 logits and tokens."""
    if "--dtype" not in args:
        args = ("--dtype", "float32", *args)
    os.makedirs(rundir, exist_ok=True)
    log = os.path.join(rundir, "predd.log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "predd", "--rundir", rundir, *args],
        stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True, cwd=ROOT,
        env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)
    deadline = time.monotonic() + timeout
    line = proc.stdout.readline()
    while not line.startswith("ready ") and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"predd exited {proc.returncode}: {open(log).read()[-2000:]}")
        line = proc.stdout.readline()
    if not line.startswith("ready "):
        proc.kill()
        raise RuntimeError("predd did not become ready")
    return Daemon(proc, line.split()[1], rundir, log)


PREDD_ARGS = ("--kv-pages", "1024", "--max-step-tokens", "256", "--lease", "3")


@pytest.fixture(scope="session")
def predd(tmp_path_factory):
    """One real predd (SmolLM2-135M, fp32, CPU) shared by the integration tests."""
    daemon = start_predd(str(tmp_path_factory.mktemp("predd")), *PREDD_ARGS)
    os.environ["PREDD_ADDR"] = daemon.addr
    yield daemon
    code = daemon.stop()
    assert code == 0, f"predd exited {code}"


@pytest.fixture
def lip(predd):
    """liblip connected to the shared predd; fsck must be clean after the test."""
    import liblip
    liblip.connect(predd.addr)
    yield liblip
    report = liblip.fsck()
    assert report["clean"], report["problems"]
