"""Many users at once: 100 concurrent `cp` forks and `rm`s, 10 LIP processes decoding
from forks of one prefix file, one user making 10,000 files, and a directory of 2,000
listed whole and resumed at any offset. (Per-operation cost at 100,000 files:
scripts/bench_kvfs_scale.py; no test asserts on time.)"""
import ctypes
import errno
import os
import platform
import struct
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvfsd.namespace import NAMES_PER_UID
from tests.conftest import ROOT
from tests.integration.kvfs_fixtures import (FD, NOBODY, eventually, fill, saved_state, sh,
                                             syscalls, xattr_int)

pytestmark = pytest.mark.slow        # hundreds of forks, ten LIPs, ten thousand files

PROMPT = ("You are a helpful assistant. Answer briefly.\n"
          "Question: What is the capital of France?\nAnswer:")
DECODE = 8


def test_100_parallel_forks_then_100_removals(kvfs, lip):
    m = kvfs.mount
    sh("touch base.kv", cwd=m)
    caps0 = lip.stats()["capabilities"]
    fill(lip, f"{m}/base.kv", lip.tokenize(PROMPT)[:20])
    assert eventually(lambda: lip.stats()["capabilities"] == caps0)
    start = lip.stats()
    with ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(lambda i: sh(f"cp base.kv f{i}.kv", cwd=m), range(100)))
    assert [r.returncode for r in results] == [0] * 100, [r.stderr for r in results][:3]
    assert len(os.listdir(m)) == 101
    assert {xattr_int(f"{m}/f{i}.kv", "tokens") for i in range(100)} == {20}
    assert lip.stats()["pages_free"] == start["pages_free"]      # forks share every page
    assert eventually(lambda: lip.stats()["objects"] == start["objects"] + 100)
    with ThreadPoolExecutor(max_workers=100) as pool:
        results = list(pool.map(lambda i: sh(f"rm f{i}.kv", cwd=m), range(100)))
    assert [r.returncode for r in results] == [0] * 100
    assert os.listdir(m) == ["base.kv"]
    assert eventually(lambda: lip.stats()["objects"] == start["objects"])
    end = lip.stats()
    assert end["pages_free"] == start["pages_free"]
    assert end["capabilities"] == start["capabilities"]
    report = lip.fsck()
    assert report["clean"], report["problems"]


LIP = textwrap.dedent("""
    import sys
    import liblip as lip
    prefix = lip.kv_open(sys.argv[1])           # a permission-checked open of the file
    kv = lip.kv_fork(prefix)
    lip.kv_close(prefix)
    print("ready", flush=True)
    sys.stdin.readline()                        # start decoding together
    token, out = int(sys.argv[2]), []
    for _ in range(int(sys.argv[3])):
        token = lip.pred(kv, [token]).argmax()
        out.append(token)
    lip.kv_save(kv, sys.argv[4])                # publish the answer as a file (a fork)
    lip.kv_free(kv)
    print(" ".join(map(str, out)))
""")


def test_10_lips_decode_in_parallel_from_one_prefix_file(kvfs, lip, tmp_path):
    m = kvfs.mount
    prompt = lip.tokenize(PROMPT)
    sh("touch prefix.kv", cwd=m)
    fill(lip, f"{m}/prefix.kv", prompt[:-1])
    # The reference: one fork, decoded alone.
    with lip.kv_open(f"{m}/prefix.kv") as prefix:
        ref_kv = lip.kv_fork(prefix)
    token, expected = prompt[-1], []
    for _ in range(DECODE):
        token = lip.pred(ref_kv, [token]).argmax()
        expected.append(token)
    lip.kv_free(ref_kv)

    script = tmp_path / "decode.py"
    script.write_text(LIP)
    env = {**os.environ, "PREDD_ADDR": kvfs.addr, "KVFS_MOUNT": m, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, str(script), "prefix.kv", str(prompt[-1]),
                               str(DECODE), f"answer{i}.kv"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(10)]
    for p in procs:
        assert p.stdout.readline() == "ready\n", p.stderr.read()
    before = lip.stats()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=120) for p in procs]
    after = lip.stats()
    assert [p.returncode for p in procs] == [0] * 10, [e for _, e in outs][:2]
    for out, _ in outs:
        assert [int(t) for t in out.split()] == expected
    for i in range(10):
        assert xattr_int(f"{m}/answer{i}.kv", "tokens") == len(prompt) - 1 + DECODE
    # Only the new tokens were computed: the prefix was shared, never recomputed.
    assert after["tokens_computed"] - before["tokens_computed"] == 10 * DECODE
    batch = (after["calls"] - before["calls"]) / max(1, after["steps"] - before["steps"])
    print(f"\n10 LIPs x {DECODE} tokens: {after['steps'] - before['steps']} steps, "
          f"mean batch {batch:.1f}")


def test_10000_files_from_one_user_are_bounded(kvfs, lip):
    """One user creating 10,000 files gets the first NAMES_PER_UID (4096) and EDQUOT for
    the rest, before predd is asked for anything; each create costs the same at the
    end as at the start (the state is written incrementally), and others still work."""
    m = kvfs.mount
    objects = lip.stats()["objects"]
    creat = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    results, times = [], []
    for start in range(0, 10_000, 1000):
        t = time.perf_counter()
        results += syscalls(*[step for i in range(start, start + 1000)
                              for step in (("open", f"{m}/u{i}.kv", creat, 0o600),
                                           ("close", FD))])
        times.append(time.perf_counter() - t)
    print(f"\n10,000 creates by one uid, s per 1000: {' '.join(f'{t:.1f}' for t in times)}")
    refused = 10_000 - NAMES_PER_UID
    assert results[0::2] == ["fd"] * NAMES_PER_UID + [-errno.EDQUOT] * refused
    assert results[1::2] == [None] * NAMES_PER_UID + [-errno.EBADF] * refused
    assert len(os.listdir(m)) == NAMES_PER_UID
    assert lip.stats()["objects"] == objects + NAMES_PER_UID
    assert len(saved_state(kvfs.state)["entries"]) == NAMES_PER_UID
    # Another user (root here) still creates, lists and removes at once.
    assert sh("touch other.kv && ls | wc -l && rm other.kv", cwd=m).stdout.split() == \
        [str(NAMES_PER_UID + 1)]
    assert os.stat(f"{m}/u4095.kv").st_uid == NOBODY


# ---------------------------------------------------------------- big directories

SYS_GETDENTS64 = {"x86_64": 217, "aarch64": 61}.get(platform.machine())
_libc = ctypes.CDLL(None, use_errno=True)


def getdents(fd: int, size: int = 2048) -> list[tuple[int, bytes]]:
    """One getdents64(2) call: the (d_off, name) of each entry it returned."""
    buf = ctypes.create_string_buffer(size)
    n = _libc.syscall(SYS_GETDENTS64, fd, buf, size)
    if n < 0:
        raise OSError(ctypes.get_errno(), "getdents64")
    raw, out, at = buf.raw[:n], [], 0
    while at < n:
        _, off, reclen, _ = struct.unpack_from("<QqHB", raw, at)
        out.append((off, raw[at + 19:at + reclen].split(b"\0", 1)[0]))
        at += reclen
    return out


def read_dir(fd: int, offset: int) -> list[tuple[int, bytes]]:
    """Every entry from `offset` (0, or a d_off an earlier read returned) to the end,
    in small reads, so kvfsd is asked many times, each from where the last one ended."""
    os.lseek(fd, offset, os.SEEK_SET)
    out = []
    while batch := getdents(fd):
        out += batch
    return out


@pytest.mark.skipif(SYS_GETDENTS64 is None, reason="getdents64 number unknown here")
def test_2000_files_are_listed_whole_and_resumed_at_any_offset(kvfs, lip):
    """ls sees every name; a readdir resumed at any offset it handed out continues with
    exactly the names after it, also after removals and additions meanwhile."""
    d = kvfs.path("big")
    os.mkdir(d)
    names = [f"f{i:04d}.kv".encode() for i in range(2000)]
    for name in names:
        os.close(os.open(os.path.join(d.encode(), name), os.O_WRONLY | os.O_CREAT
                         | os.O_EXCL, 0o600))
    assert sorted(os.listdir(d.encode())) == names
    r = sh("LC_ALL=C ls big", cwd=kvfs.mount)
    assert r.stdout.encode().split() == names, r.stderr
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        whole = read_dir(fd, 0)
        assert [name for _, name in whole] == [b".", b".."] + names     # creation order
        offsets = [off for off, _ in whole]
        assert offsets == sorted(set(offsets))
        for k in range(0, len(whole), 97):
            assert read_dir(fd, whole[k][0]) == whole[k + 1:]
        # whole[k] is names[k - 2]: resume after names[998] once a third of all names
        # went and 50 came.
        for name in names[::3]:
            os.unlink(os.path.join(d.encode(), name))
        new = [f"new{i}.kv".encode() for i in range(50)]
        for name in new:
            os.close(os.open(os.path.join(d.encode(), name), os.O_WRONLY | os.O_CREAT, 0o600))
        kept = [name for i, name in enumerate(names) if i % 3]
        assert [name for _, name in read_dir(fd, whole[1000][0])] == \
            [name for name in names[999:] if name in set(kept)] + new
        assert [name for _, name in read_dir(fd, 0)] == [b".", b".."] + kept + new
    finally:
        os.close(fd)
    assert len(saved_state(kvfs.state)["entries"]) == len(kept) + len(new) + 1   # + big
