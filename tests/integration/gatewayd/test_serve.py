"""`symphony serve` as an operator meets it: refusals before anything starts (clear line,
non-zero status), one `ready http://HOST:PORT` line, prefixed logs, a clean stop in
order on Ctrl+C (runs killed, unmounted, exit 0; SIGTERM is what every other gateway
test module's teardown sends), and a stop of everything when a part dies."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tests.conftest import ROOT
from tests.integration.gateway_fixtures import (LIPS, eventually, free_port, sse_events,
                                                start_serve)
from tests.integration.kvfs_fixtures import force_unmount, is_mounted, make_mountpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="symphony serve needs root")


def serve(tmp_path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `symphony serve` expecting it to refuse (it must exit by itself)."""
    argv = [sys.executable, "-m", "gatewayd.serve", "serve", "--rundir",
            str(tmp_path / "run"), "--state", str(tmp_path / "state"), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})


def test_refuses_a_public_address_without_keys(tmp_path):
    r = serve(tmp_path, "--listen", f"0.0.0.0:{free_port()}", "--mount", str(tmp_path / "m"))
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.startswith("symphony: --listen 0.0.0.0:")
    assert "loopback only" in r.stderr and "predd:" not in r.stderr


def test_refuses_a_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = serve(tmp_path, "--listen", f"127.0.0.1:{port}", "--mount", str(tmp_path / "m"))
    assert r.returncode == 1
    assert f"--listen 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "predd:" not in r.stderr            # refused before loading a model


def test_refuses_a_busy_mount(tmp_path):
    r = serve(tmp_path, "--listen", f"127.0.0.1:{free_port()}", "--mount", "/proc")
    assert r.returncode == 1
    assert "--mount /proc: something is mounted there already" in r.stderr


def test_refuses_a_missing_model(tmp_path):
    r = serve(tmp_path, "--listen", f"127.0.0.1:{free_port()}", "--mount",
              str(tmp_path / "m"), "--model", str(tmp_path / "no-such.gguf"))
    assert r.returncode == 1
    assert "no-such.gguf: no such file or directory" in r.stderr


def test_refuses_a_readable_keys_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("sk-alice-0123456789abcdef 1001 alice\n")
    os.chmod(keys, 0o644)
    r = serve(tmp_path, "--listen", f"127.0.0.1:{free_port()}", "--mount",
              str(tmp_path / "m"), "--api-keys", str(keys))
    assert r.returncode == 2
    assert "mode 0644 lets group or others read it (chmod 600)" in r.stderr
    keys.write_text("sk-short 1001\n")
    os.chmod(keys, 0o600)
    r = serve(tmp_path, "--listen", f"127.0.0.1:{free_port()}", "--mount",
              str(tmp_path / "m"), "--api-keys", str(keys))
    assert r.returncode == 2 and "keys:1: key shorter than 16 characters" in r.stderr


def test_predd_refusing_its_flags_stops_the_start(tmp_path):
    mount = make_mountpoint()
    try:
        r = serve(tmp_path, "--listen", f"127.0.0.1:{free_port()}", "--mount", mount,
                  "--kv-pages", "0")
        assert r.returncode == 1
        assert "predd: " in r.stderr and "--kv-pages must be >= 1" in r.stderr
        assert "symphony: predd exited with status 2 before it was ready" in r.stderr
        assert not is_mounted(mount)
    finally:
        os.rmdir(mount)


@pytest.mark.slow
def test_ready_line_logs_and_clean_stop_on_ctrl_c(tmp_path):
    s = start_serve(str(tmp_path), "--programs", LIPS)
    try:
        assert s.ready_line == f"ready {s.url}"
        with httpx.Client(base_url=s.url, timeout=60) as http:
            assert http.get("/health").json()["status"] == "ok"
            r = http.post("/v1/runs", json={"filename": "x.py", "source": "print(1)"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "EPERM"
            r = http.post("/v1/programs/holder/runs",
                          json={"interactive": True, "detach": True})
            assert r.status_code == 201
            with http.stream("GET", f"/v1/runs/{r.json()['id']}/events") as events:
                for e in sse_events(events):
                    if e.kind == "stdout":
                        break
        os.killpg(s.proc.pid, signal.SIGINT)      # Ctrl+C: the terminal's whole group
        assert s.proc.wait(timeout=120) == 0
        assert s.proc.stdout.read() == ""                 # `ready` was the only line
        log = s.log_text()
        for prefix in ("predd: ", "kvfsd: ", "gatewayd: ", "symphony: "):
            assert any(line.startswith(prefix) for line in log.splitlines()), prefix
        assert "gatewayd: run run_" in log and "(ESHUTDOWN: the server is stopping)" in log
        assert log.rstrip().endswith("symphony: stopped")
        order = [log.index(x) for x in ("symphony: stopping: gateway", "gatewayd: Finished",
                                        "kvfsd: unmounted", "predd: stopping")]
        assert order == sorted(order)
        assert not is_mounted(s.mount)
        assert not os.path.exists(os.path.join(s.rundir, "predd.sock"))
    finally:
        s.stop()
        os.rmdir(s.mount)


@pytest.mark.slow
def test_a_part_that_dies_stops_the_rest(tmp_path):
    s = start_serve(str(tmp_path))
    try:
        kvfsd = subprocess.run(["pgrep", "-f", f"kvfsd {s.mount}"], capture_output=True,
                               text=True).stdout.split()
        assert len(kvfsd) == 1
        os.kill(int(kvfsd[0]), signal.SIGKILL)
        assert s.proc.wait(timeout=120) == 1
        log = s.log_text()
        assert "symphony: kvfsd exited (-9); stopping the rest" in log
        assert eventually(lambda: not is_mounted(s.mount), timeout=10)
        assert "predd: stopping" in log
    finally:
        s.stop()
        force_unmount(s.mount)
        os.rmdir(s.mount)
