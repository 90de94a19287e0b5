"""LIPs under another uid, for tests of what predd lets each uid do.

`AsUid(uid, addr)` is a child Python process that imports liblip as root, then drops
to `uid` (setgroups/setgid/setuid: the kernel, and so predd's SO_PEERCRED, sees that
uid) and evaluates the statements the test sends it, one per line. The venv's Python
lives under /root, which another uid cannot read, hence importing before dropping.
Its predd must listen where that uid can reach: `open_rundir()` (under /tmp, 0755).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from predd.server.launch import die_with_parent, read_line
from tests.conftest import ROOT

AGENT = r"""
import json, os, sys
import liblip.client
from liblip.client import Client, LipError
uid = int(sys.argv[1])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
ns = {"Client": Client, "LipError": LipError, "addr": sys.argv[2], "os": os}
print(json.dumps({"ready": os.getuid()}), flush=True)
for line in sys.stdin:
    kind, code = json.loads(line)
    try:
        if kind == "exec":
            exec(code, ns)
            out = {"value": None}
        else:
            out = {"value": eval(code, ns)}
    except LipError as exc:
        out = {"errno": exc.code, "message": exc.message}
    except Exception as exc:
        out = {"exception": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out), flush=True)
"""

ANSWER_S = 60          # the longest an agent may take to start or to answer one statement
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run as other uids")


def open_rundir() -> str:
    """A run directory other uids can traverse (pytest's tmp_path is 0700)."""
    path = tempfile.mkdtemp(prefix="predd-trust-", dir="/tmp")
    os.chmod(path, 0o755)
    return path


class LipFailed(Exception):
    def __init__(self, errno: str, message: str) -> None:
        super().__init__(f"{errno}: {message}")
        self.errno = errno


class AsUid:
    def __init__(self, uid: int, addr: str) -> None:
        self.uid = uid
        self.proc = subprocess.Popen(
            [sys.executable, "-c", AGENT, str(uid), addr], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=ROOT, preexec_fn=die_with_parent,
            env={**os.environ, "PYTHONPATH": ROOT})
        hello = json.loads(read_line(self.proc, ANSWER_S) or "{}")
        assert hello == {"ready": uid}, hello

    def _ask(self, kind: str, code: str):
        self.proc.stdin.write(json.dumps([kind, code]) + "\n")
        self.proc.stdin.flush()
        line = read_line(self.proc, ANSWER_S)
        assert line, f"agent for uid {self.uid} died or gave no answer in {ANSWER_S} s"
        out = json.loads(line)
        if "errno" in out:
            raise LipFailed(out["errno"], out["message"])
        assert "exception" not in out, out["exception"]
        return out["value"]

    def do(self, statement: str) -> None:
        self._ask("exec", statement)

    def eval(self, expression: str):
        return self._ask("eval", expression)

    def errno(self, expression: str) -> str:
        """The errno name `expression` fails with (the test fails if it succeeds)."""
        with pytest.raises(LipFailed) as err:
            self.eval(expression)
        return err.value.errno

    def close(self) -> None:
        """Close the agent's clients (ending their sessions), then the agent."""
        if self.proc.poll() is None:
            self.do("[v.close() for v in list(globals().values()) if isinstance(v, Client)]")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
