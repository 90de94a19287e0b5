"""predd's run directory: another user must not be able to pre-create it and have
predd's socket (and so its clients) there. No model: the engine is never built."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from predd.server.loop import Server

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")


def _no_engine(send, log):
    return SimpleNamespace(max_message_bytes=1 << 20)   # all Server reads before bind


def start(rundir: str, logs: list[str]) -> int:
    """Start a Server at rundir/predd.sock; 0 when it bound, else its exit code."""
    try:
        server = Server(f"ipc://{rundir}/predd.sock", _no_engine, log=logs.append)
    except SystemExit as exc:
        return exc.code
    server.sock.close(0)
    return 0


def test_creates_rundir_0755_and_binds(tmp_path):
    rundir, logs = str(tmp_path / "run"), []
    old = os.umask(0o077)   # a strict umask must not make it unreachable
    try:
        assert start(rundir, logs) == 0
    finally:
        os.umask(old)
    assert oct(os.stat(rundir).st_mode & 0o777) == "0o755"
    assert logs == []


@pytest.mark.parametrize("owner,mode", [(65534, 0o755), (0, 0o777), (0, 0o775), (0, 0o1777)])
def test_refuses_a_rundir_others_own_or_can_write(tmp_path, owner, mode):
    rundir, logs = str(tmp_path / "run"), []
    os.mkdir(rundir)
    os.chown(rundir, owner, owner)
    os.chmod(rundir, mode)
    assert start(rundir, logs) == 2
    assert logs == [f"EPERM: run directory {rundir} must be a directory owned by uid 0 and "
                    f"not writable by group or others (it is {oct(mode)}, uid {owner}); "
                    "refusing to start"]
    assert not os.path.exists(f"{rundir}/predd.sock")


def test_refuses_a_rundir_that_is_a_link(tmp_path):
    os.mkdir(tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", tmp_path / "run")
    logs: list[str] = []
    assert start(str(tmp_path / "run"), logs) == 2
    assert "(it is a link, uid 0)" in logs[0]
    assert os.listdir(tmp_path / "elsewhere") == []


def test_replaces_a_stale_socket_in_its_own_rundir(tmp_path):
    rundir, logs = str(tmp_path / "run"), []
    os.mkdir(rundir, 0o700)
    open(f"{rundir}/predd.sock", "w").close()
    assert start(rundir, logs) == 0
    assert os.path.exists(f"{rundir}/predd.sock")
