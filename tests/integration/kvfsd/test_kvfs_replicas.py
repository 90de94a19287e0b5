"""kvfsd over two real predd replicas (A, B) with one namespace: every file has a home
(`user.kv.replica`, and `replica ADDR` in its descriptor); a descriptor from B homes a
new file on B; `user.kv.rehome` moves a cache bit-exactly (same tokens, same logits,
counted in the root's `user.kv.migrations` with the export's bytes); cp across replicas
migrates; a killed replica gives EIO for its files only, an fsync'd one comes back on
A; B restarted gets back only its own fsync'd files; the state stays clean; a kvfsd
restarted without B re-homes B's fsync'd files onto A."""
import errno
import os
import re
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from predd.server.launch import Daemon, die_with_parent, wait_ready
from tests.conftest import ROOT
from tests.integration.kvfs_fixtures import (Kvfs, eventually, finish, make_mountpoint, sh,
                                             start_kvfsd)
from symphony_protocol import descriptor
pytestmark = pytest.mark.slow

PAGES = 256
PREDD_ARGS = ("--dtype", "float32", "--kv-pages", str(PAGES), "--max-step-tokens", "256", "--lease", "3",
              "--threads", "1")
PROMPT = "Replicas: one namespace over two predds, and caches that move between them."


def spawn_predd(rundir: str) -> subprocess.Popen:
    """A predd on its own ipc socket, started from this thread (PR_SET_PDEATHSIG follows
    the thread that forks); `wait_ready` it."""
    os.makedirs(rundir, exist_ok=True)
    with open(os.path.join(rundir, "predd.log"), "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "predd", "--rundir", rundir, "--addr",
             f"ipc://{rundir}/p.sock", *PREDD_ARGS], stdout=subprocess.PIPE, stderr=err,
            cwd=ROOT, preexec_fn=die_with_parent)


@pytest.fixture(scope="module")
def replicas():
    """Two predds, each on its own ipc socket (short paths under /tmp), loading at once."""
    top = tempfile.mkdtemp(prefix="kvr-", dir="/tmp")
    dirs = [os.path.join(top, name) for name in ("a", "b")]
    procs = [spawn_predd(d) for d in dirs]
    daemons = []
    for proc, d in zip(procs, dirs):
        addr = wait_ready(proc, 120.0)
        if addr is None:
            for p in procs:
                p.kill()
            with open(os.path.join(d, "predd.log"), errors="replace") as f:
                raise RuntimeError(f"predd did not start: {f.read()[-2000:]}")
        daemons.append(Daemon(proc, addr.split()[0], d, os.path.join(d, "predd.log")))
    yield daemons             # (a test may replace one it restarted)
    import liblip
    if _talking_to:
        liblip.client().close()
        _talking_to.clear()
    for daemon in daemons:
        daemon.stop()
    subprocess.run(["rm", "-rf", top], check=False)


_talking_to: list[str] = []


def on(addr: str):
    """liblip, talking to the predd at `addr`."""
    import liblip
    if _talking_to != [addr]:
        liblip.connect(addr, dead_after_s=60)
        _talking_to[:] = [addr]
    return liblip


def read_descriptor(path: str, write: bool = False) -> tuple[int, descriptor.Descriptor]:
    """An open of a cache file (kept: its grant lives as long) and its descriptor."""
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    return fd, descriptor.parse(os.pread(fd, descriptor.MAX_LEN, 0))


def kv_of(desc: descriptor.Descriptor):
    """liblip on the descriptor's replica, and a handle to its capability."""
    lip = on(desc.replica)
    return lip, lip.KV.from_capability(desc.cap, desc.rights)


def fill(path: str, tokens: list[int]) -> None:
    fd, desc = read_descriptor(path, write=True)
    try:
        lip, kv = kv_of(desc)
        lip.prefill(kv, tokens)
    finally:
        os.close(fd)


def facts(path: str, token: int) -> tuple[list[int], np.ndarray, int]:
    """A cache file's tokens, the logits after `token` on a fork of it (the file is not
    changed), and the length of its kv_export — asked of its home replica."""
    fd, desc = read_descriptor(path)
    try:
        lip, kv = kv_of(desc)
        tokens = lip.kv_tokens(kv)
        size = len(lip.kv_export(kv))
        fork = lip.kv_fork(kv)
        logits = lip.pred(fork, [token]).logits.copy()
        lip.kv_free(fork)
    finally:
        os.close(fd)
    return tokens, logits, size


def home(path: str) -> str:
    return os.getxattr(path, "user.kv.replica").decode()


def replica_line(path: str) -> str:
    fd, desc = read_descriptor(path)
    os.close(fd)
    return desc.replica


def migrations(mount: str) -> str:
    return os.getxattr(mount, "user.kv.migrations").decode()


def replicas_table(mount: str) -> list[tuple[str, str, int, int]]:
    """(address, up|down, files, pages total) per line of the root's user.kv.replicas."""
    out = []
    for line in os.getxattr(mount, "user.kv.replicas").decode().splitlines():
        m = re.fullmatch(r"(\S+) (up|down) files=(\d+) pages=(\d+)/(\d+) calls=(\d+)", line)
        assert m is not None, line
        assert int(m[4]) <= int(m[5])
        out.append((m[1], m[2], int(m[3]), int(m[5])))
    return out


def errno_of(fn, *args) -> int:
    with pytest.raises(OSError) as e:
        fn(*args)
    return e.value.errno


def make_on(addr: str, path: str, tokens: list[int]) -> None:
    """Write into `path` the descriptor of a cache made on replica `addr` (what lip
    kv_save of an object on that replica writes), then free the object."""
    lip = on(addr)
    kv = lip.kv_create()
    lip.prefill(kv, tokens)
    text = descriptor.Descriptor(kv.cap, kv.rights, replica=addr).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text)
    finally:
        os.close(fd)
    lip.kv_free(kv)


def fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_replicas_share_one_namespace_and_caches_move_between_them(replicas, tmp_path):
    a, b = replicas
    A, B = a.addr, b.addr
    state = str(tmp_path / "state")
    kvfs = start_kvfsd(A, state, "--predd", B)
    m = kvfs.mount
    try:
        tokens = on(A).tokenize(PROMPT)
        probe = on(A).tokenize(" next")[0]
        assert migrations(m) == "0 0"
        assert os.statvfs(m).f_blocks == 2 * PAGES             # df: both pools

        # A new file lives on A, the first replica; its descriptor says so.
        x = os.path.join(m, "x.kv")
        open(x, "w").close()
        assert home(x) == A and replica_line(x) == A
        fill(x, tokens)
        before = facts(x, probe)
        assert before[0] == tokens

        # A descriptor made on B homes a new file on B (it was empty: no migration).
        y = os.path.join(m, "y.kv")
        make_on(B, y, tokens[:7])
        assert home(y) == B and replica_line(y) == B
        assert facts(y, probe)[0] == tokens[:7]
        assert migrations(m) == "0 0"
        assert [row[:3] for row in replicas_table(m)] == [(A, "up", 1), (B, "up", 1)]
        assert [row[3] for row in replicas_table(m)] == [PAGES, PAGES]

        # Rehome x onto B: same tokens, bit-identical logits, counted with its bytes.
        os.setxattr(x, "user.kv.rehome", B.encode())
        assert home(x) == B and replica_line(x) == B
        after = facts(x, probe)
        assert after[0] == before[0]
        assert np.array_equal(after[1], before[1])
        assert migrations(m) == f"1 {before[2]}"
        os.setxattr(x, "user.kv.rehome", B.encode())             # already there: no-op
        assert migrations(m) == f"1 {before[2]}"

        # cp of a non-empty file on A over a non-empty file on B: migrated, counted.
        z = os.path.join(m, "z.kv")
        open(z, "w").close()
        fill(z, tokens[:12])
        z_facts = facts(z, probe)
        assert home(z) == A
        assert sh("cp z.kv y.kv", cwd=m).returncode == 0
        assert home(y) == B
        y_facts = facts(y, probe)
        assert y_facts[0] == tokens[:12]
        assert np.array_equal(y_facts[1], z_facts[1])
        assert migrations(m) == f"2 {before[2] + z_facts[2]}"

        # Errors: open file EBUSY, unknown address EINVAL, user.kv.replica EPERM.
        fd = os.open(z, os.O_RDONLY)
        try:
            assert errno_of(os.setxattr, z, "user.kv.rehome", B.encode()) == errno.EBUSY
        finally:
            os.close(fd)
        assert errno_of(os.setxattr, z, "user.kv.rehome", b"ipc:///tmp/nowhere.sock") \
            == errno.EINVAL
        assert errno_of(os.setxattr, z, "user.kv.rehome", b"elsewhere") == errno.EINVAL
        assert errno_of(os.setxattr, z, "user.kv.replica", B.encode()) == errno.EPERM
        assert errno_of(os.setxattr, m, "user.kv.migrations", b"0 0") == errno.EPERM
        assert home(z) == A
        assert migrations(m) == f"2 {before[2] + z_facts[2]}"
        assert set(os.listxattr(m)) >= {"user.kv.replicas", "user.kv.migrations"}

        # Two fsync'd files on B (one to rehome by hand, one for the restart), one not.
        s1, s2, s3 = (os.path.join(m, f"s{i}.kv") for i in (1, 2, 3))
        for path, n in ((s1, 9), (s2, 10), (s3, 11)):
            make_on(B, path, tokens[:n])
            assert home(path) == B
        fsync(s1)
        fsync(s2)
        s1_facts = facts(s1, probe)

        # Kill B: its files give EIO, A's still work.
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait()
        assert errno_of(os.open, y, os.O_RDONLY) == errno.EIO
        assert errno_of(os.getxattr, x, "user.kv.tokens") == errno.EIO
        assert facts(z, probe)[0] == tokens[:12]
        assert os.statvfs(m).f_blocks == PAGES                  # df: the live pool
        assert [row[:3] for row in replicas_table(m)][1] == (B, "down", 5)

        # A file without a snapshot cannot leave a dead replica; an fsync'd one can.
        assert errno_of(os.setxattr, s3, "user.kv.rehome", A.encode()) == errno.EIO
        assert errno_of(os.setxattr, s1, "user.kv.rehome", B.encode()) == errno.EIO
        os.setxattr(s1, "user.kv.rehome", A.encode())
        assert home(s1) == A and replica_line(s1) == A
        restored = facts(s1, probe)
        assert restored[0] == tokens[:9]
        assert np.array_equal(restored[1], s1_facts[1])
        assert migrations(m) == f"2 {before[2] + z_facts[2]}"    # a restore, not a move

        # B again at its address (a new predd): its fsync'd file comes back on it, its
        # other files go; A is not re-validated and its files are untouched.
        proc = spawn_predd(b.rundir)
        assert wait_ready(proc, 120.0) is not None
        b = replicas[1] = Daemon(proc, B, b.rundir, b.log)
        assert eventually(lambda: "/s2.kv: restored from its fsync'd snapshot (10 tokens)"
                          in kvfs.log_text(), timeout=60)
        assert home(s2) == B and facts(s2, probe)[0] == tokens[:10]
        assert sorted(os.listdir(m)) == ["s1.kv", "s2.kv", "z.kv"]
        assert facts(z, probe)[0] == tokens[:12] and facts(s1, probe)[0] == tokens[:9]
        log = kvfs.log_text()
        for name in ("x", "y", "s3"):
            assert f"/{name}.kv: cache lost (predd restarted and it was never fsync'd)" in log
        assert f"re-validating caches: predd at {B} restarted" in log
        assert f"predd at {A} restarted" not in log
        assert "/z.kv: restored" not in log and "/s1.kv: restored from" not in log
        assert [row[:3] for row in replicas_table(m)] == [(A, "up", 2), (B, "up", 1)]
        b.proc.send_signal(signal.SIGKILL)          # gone for good: see the restart below
        b.proc.wait()
    finally:
        code = finish(kvfs, clear=False)
    assert code == 0, kvfs.log_text()[-2000:]

    check = subprocess.run([sys.executable, "-m", "kvfsd.check", state], cwd=ROOT,
                           capture_output=True, text=True)
    assert (check.returncode, check.stdout) == (0, "clean\n")

    # kvfsd again, with A only: B's fsync'd file comes onto A, the others are gone.
    kvfs = Kvfs(make_mountpoint(), state, A, f"{state}.log2").start()
    m = kvfs.mount
    try:
        s2 = os.path.join(m, "s2.kv")
        assert home(s2) == A and replica_line(s2) == A
        assert facts(s2, probe)[0] == tokens[:10]
        assert sorted(os.listdir(m)) == ["s1.kv", "s2.kv", "z.kv"]
        assert migrations(m) == "0 0"
        assert [row[:3] for row in replicas_table(m)] == [(A, "up", 3)]
        log = kvfs.log_text()
        assert f"/s2.kv: its replica {B} is not one of kvfsd's; re-homing it onto {A}" in log
        assert "/s2.kv: restored from its fsync'd snapshot (10 tokens)" in log
    finally:
        code = finish(kvfs)
    assert code == 0, kvfs.log_text()[-2000:]
    report = on(A).fsck()
    assert report["clean"], report["problems"]
