"""Starting a predd from another program (the tests, the benchmarks) and waiting for it.

`start(rundir, *args)` runs `python -m predd --rundir RUNDIR ARGS...` with stderr in
RUNDIR/predd.log, waits at most `timeout` seconds for its `ready ADDR` line, and returns
a `Daemon`. The daemon gets SIGTERM if the program that started it dies. `wait_ready`
does the bounded wait for any daemon that announces itself that way (kvfsd, `symphony
serve`). Nothing here imports torch.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above predd/


@dataclass
class Daemon:
    proc: subprocess.Popen
    addr: str
    rundir: str
    log: str

    def stop(self, timeout: float = 20.0) -> int:
        return terminate(self.proc, timeout)


def terminate(proc: subprocess.Popen, timeout: float, group: bool = False) -> int:
    """SIGTERM, then SIGKILL (to its whole process group with `group`) past `timeout`
    seconds; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
    return proc.returncode


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies (no orphans)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def read_line(proc: subprocess.Popen, timeout: float) -> str | None:
    """The next line `proc` writes on its stdout (a pipe), without its newline; None when
    `timeout` seconds pass or stdout closes first. Reads byte by byte, never past the
    line, so what follows is still there for the caller (a partial line is lost)."""
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    line = bytearray()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        byte = os.read(fd, 1)
        if not byte:
            return None
        if byte == b"\n":
            return line.decode(errors="replace")
        line += byte


def wait_ready(proc: subprocess.Popen, timeout: float) -> str | None:
    """What follows `ready ` in the first such line of `proc`'s stdout, or None when
    `timeout` seconds pass or stdout closes first."""
    deadline = time.monotonic() + timeout
    while (line := read_line(proc, deadline - time.monotonic())) is not None:
        if line.startswith("ready "):
            return line[len("ready "):]
    return None


def start(rundir: str, *args: str, env: dict | None = None,
          timeout: float = 120.0) -> Daemon:
    """predd with `args`, serving; RuntimeError (with its log's tail) if it exits or
    stays silent for `timeout` seconds."""
    os.makedirs(rundir, exist_ok=True)
    log = os.path.join(rundir, "predd.log")
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "predd", "--rundir", rundir, *args],
            stdout=subprocess.PIPE, stderr=err, cwd=ROOT,
            env={**os.environ, **(env or {})}, preexec_fn=die_with_parent)
    addr = wait_ready(proc, timeout)
    if addr is None:
        try:
            why = f"exited {proc.wait(timeout=2)}"
        except subprocess.TimeoutExpired:
            why = f"was not ready in {timeout:g} s"
            proc.kill()
            proc.wait()
        proc.stdout.close()
        with open(log, errors="replace") as f:
            raise RuntimeError(f"predd {why}: {f.read()[-2000:]}")
    return Daemon(proc, addr.split()[0], rundir, log)
