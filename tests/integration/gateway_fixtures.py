"""A real `symphony serve` for the gateway tests: predd (real model), kvfsd on a fresh
mount, the gateway on 127.0.0.1 at a free port — started once per test module, stopped
with SIGTERM at its end (exit status 0 and no mount left are checked there).

Also: a small SSE reader over httpx, and a predd client for the server's figures.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

import httpx
import pytest

from liblip.client import Client
from predd.server.launch import die_with_parent, terminate, wait_ready
from tests.conftest import ROOT
from tests.integration.kvfs_fixtures import eventually as poll_until
from tests.integration.kvfs_fixtures import force_unmount, is_mounted, make_mountpoint

LIPS = os.path.join(os.path.dirname(__file__), "gateway_lips")
SERVE_ARGS = ("--kv-pages", "512", "--max-step-tokens", "256", "--dtype", "float32")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Serve:
    proc: subprocess.Popen
    url: str
    mount: str
    rundir: str
    log: str
    ready_line: str = ""

    @property
    def predd_addr(self) -> str:
        return f"ipc://{self.rundir}/predd.sock"

    def predd(self) -> Client:
        """A predd client of the test itself (root: it sees every session)."""
        return Client(self.predd_addr, name="gateway-test")

    def log_text(self) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()

    def stop(self, timeout: float = 90.0) -> int:
        """SIGTERM and wait; whatever happens, nothing stays mounted or running."""
        try:
            return terminate(self.proc, timeout, group=True)
        finally:
            self.proc.stdout.close()
            force_unmount(self.mount)


def start_serve(tmp: str, *args: str, timeout: float = 240.0,
                command: tuple[str, ...] = (sys.executable, "-m", "gatewayd.serve"),
                cwd: str = ROOT, env: dict[str, str] | None = None) -> Serve:
    """`symphony serve` with SERVE_ARGS and `args`; returns once it printed `ready`.
    By default the source tree's (`python -m gatewayd.serve` in ROOT, PYTHONPATH=ROOT);
    `command`, `cwd` and `env` run another one (an installed `symphony`)."""
    port = free_port()
    mount = make_mountpoint()
    rundir = os.path.join(tmp, "run")
    log = os.path.join(tmp, "serve.log")
    argv = [*command, "serve", "--listen", f"127.0.0.1:{port}",
            "--mount", mount, "--rundir", rundir, "--state", os.path.join(tmp, "state"),
            *SERVE_ARGS, *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True,
                            cwd=cwd, env=env or {**os.environ, "PYTHONPATH": ROOT},
                            start_new_session=True, preexec_fn=die_with_parent)
    s = Serve(proc, f"http://127.0.0.1:{port}", mount, rundir, log)
    url = wait_ready(proc, timeout)
    if url is None:
        s.stop()
        raise RuntimeError(f"symphony serve did not start in {timeout:g} s:\n"
                           f"{s.log_text()[-3000:]}")
    s.ready_line = f"ready {url}"
    return s


def finish(s: Serve) -> None:
    code = s.stop()
    assert code == 0, f"symphony serve exited {code}:\n{s.log_text()[-3000:]}"
    assert not is_mounted(s.mount)
    try:
        os.rmdir(s.mount)
    except OSError:
        pass


# ---------------------------------------------------------------- SSE

@dataclass
class Event:
    kind: str
    data: str
    id: str = ""

    def json(self):
        return json.loads(self.data)


def sse_events(response: httpx.Response):
    """The events of an SSE response, as they arrive."""
    kind, data, eid = "message", [], ""
    for line in response.iter_lines():
        if line == "":
            if data:
                yield Event(kind, "\n".join(data), eid)
            kind, data, eid = "message", [], ""
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                kind = value
            elif field == "data":
                data.append(value)
            elif field == "id":
                eid = value


def eventually(predicate, timeout: float = 30.0, interval: float = 0.1):
    """kvfs_fixtures.eventually with the patience a whole server needs."""
    return poll_until(predicate, timeout, interval)


@contextlib.contextmanager
def checked_client(server):
    """A predd client as the operator (trusted, like kvfsd); fsck must be clean after."""
    c = server.predd()
    try:
        yield c
        report = c.call("fsck")
        assert report["clean"], report["problems"]
    finally:
        c.close()


@pytest.fixture
def http(server):
    """An HTTP client of the module's `server` fixture (a `Serve`)."""
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
