"""`lip run --sandbox`: a LIP as an untrusted process still reaches predd, and nothing
else: read-only file system but its scratch dir, no network, no exec, no fork."""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from liblip.sandbox import reachable_by_others
from tests.conftest import ROOT

PROBE = os.path.join(os.path.dirname(__file__), "lips", "probe_sandbox.py")


@pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox needs root")
def test_sandboxed_lip_reaches_predd_and_nothing_else(lip, predd):
    proc = subprocess.run([sys.executable, "-m", "liblip.cli", "run", "--sandbox", PROBE],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PREDD_ADDR": predd.addr, "PROBE_REPO": ROOT})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("pred ok")
    assert lines[1:] == [
        f"write /etc denied {errno.EACCES}",
        f"write cwd repo denied {errno.EACCES}",
        "write scratch allowed",
        f"inet socket denied {errno.EACCES}",
        f"fork denied {errno.EPERM}",
        f"exec denied {errno.EPERM}",
        "thread ok",
    ]
    assert not os.path.exists(os.path.join(ROOT, "probe"))


def test_sandbox_refuses_tcp_predd():
    proc = subprocess.run([sys.executable, "-m", "liblip.cli", "run", "--sandbox", PROBE],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "PREDD_ADDR": "tcp://127.0.0.1:5555"})
    assert proc.returncode == 1
    assert proc.stderr.startswith("lip: EINVAL: sandbox:")


def test_reachable_by_others(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    (open_dir / "f").write_text("x")
    os.chmod(tmp_path, 0o755)
    os.chmod(open_dir, 0o755)
    os.chmod(open_dir / "f", 0o644)
    assert reachable_by_others([str(open_dir / "f")]) == reachable_by_others([str(tmp_path)])
    os.chmod(open_dir, 0o700)
    assert not reachable_by_others([str(open_dir / "f")])
