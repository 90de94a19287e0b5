"""predd.server.launch's bounded waits on a child's stdout, with stand-in children (no model)."""
from __future__ import annotations

import subprocess
import sys

from predd.server import launch


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_wait_ready_skips_other_lines_and_reads_no_further():
    proc = child("print('loading'); print('ready ipc:///x/predd.sock', flush=True); "
                 "print('after')")
    try:
        assert launch.wait_ready(proc, 30) == "ipc:///x/predd.sock"
        assert proc.stdout.read() == "after\n"
    finally:
        proc.wait()


def test_wait_ready_gives_up_when_stdout_closes_or_time_is_up():
    proc = child("print('no ready line here')")
    assert launch.wait_ready(proc, 30) is None
    proc.wait()
    silent = child("import time; print('ready', end='', flush=True); time.sleep(60)")
    try:
        assert launch.wait_ready(silent, 0.3) is None          # a partial line is not one
    finally:
        silent.kill()
        silent.wait()

