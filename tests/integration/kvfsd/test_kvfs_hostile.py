"""Local users and programs attacking kvfsd, on a real mount over a real predd.

Attacks a local user could make run as `nobody`, as raw syscalls in a forked child
(`syscalls`) or as coreutils under runuser. After each: kvfsd is still mounted and
serving, another user's cache is unchanged (same tokens), and predd's fsck is clean.
Every refusal has an exact errno."""
import errno
import json
import os
import stat
import time

import pytest

from symphony_protocol import descriptor
from tests.conftest import start_predd
from tests.integration.kvfs_fixtures import (FD, NOBODY, eventually, fd, fill, finish,
                                             is_mounted, revoked, saved_state, sh, start_kvfsd,
                                             syscalls, xattr_int)

TEXT = "Hostile users share this machine; each one's caches must stay their own. " * 4
E = errno


@pytest.fixture
def victim(kvfs, lip):
    """root's private cache /victim.kv with known tokens."""
    tokens = lip.tokenize(TEXT)[:37]
    assert sh("touch victim.kv", cwd=kvfs.mount).returncode == 0
    fill(lip, kvfs.path("victim.kv"), tokens)
    return tokens


def still_serving(kvfs, lip, victim_tokens) -> None:
    assert kvfs.proc.poll() is None, kvfs.log_text()[-2000:]
    assert is_mounted(kvfs.mount)
    assert "victim.kv" in os.listdir(kvfs.mount)
    assert "victim.kv" in syscalls(("listdir", kvfs.mount))[0]
    with lip.kv_open(kvfs.path("victim.kv")) as kv:
        assert lip.kv_tokens(kv) == victim_tokens
    report = lip.fsck()
    assert report["clean"], report["problems"]


def nobody_file(kvfs, lip, name: str, tokens: list[int] | None = None) -> str:
    """A cache file created by nobody (so owned and charged there), filled by root."""
    path = kvfs.path(name)
    assert syscalls(("open", path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666),
                    ("close", FD)) == ["fd", None]
    st = os.stat(path)
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o600)
    if tokens:
        fill(lip, path, tokens)
    return path


def tokens_of(lip, path: str) -> list[int]:
    with lip.kv_open(path) as kv:
        return lip.kv_tokens(kv)


def test_mount_is_nosuid_nodev_noexec(kvfs):
    with open("/proc/mounts") as f:
        options = next(ln for ln in f if ln.split()[1] == kvfs.mount).split()[3].split(",")
    assert {"nosuid", "nodev", "noexec", "default_permissions", "allow_other"} <= set(options)


def test_huge_offsets_and_lengths_are_refused_and_the_mount_stays(kvfs, lip, victim):
    """The issue's reproduction: pwrite(fd, b"k", 1 << 40) on one's own file used to
    raise MemoryError inside kvfsd, which then exited and took the mount with it."""
    mine = lip.tokenize(TEXT)[:9]
    own = nobody_file(kvfs, lip, "own.kv", mine)
    rw = os.O_RDWR
    assert syscalls(("open", own, rw), ("pwrite", FD, b"k", 1 << 40),
                    ("pwrite", FD, b"kvfs 1\n", 0),             # the open stays refused
                    ("pread", FD, 1 << 20, 1 << 40),            # far past the end: nothing
                    ("close", FD)) == ["fd", -E.EFBIG, -E.EINVAL, b"", None]
    still_serving(kvfs, lip, victim)
    big = b"kvfs 1\n" + b"x" * (1 << 20)
    assert syscalls(("open", own, rw), ("pwrite", FD, big, 0), ("close", FD),
                    ("open", own, rw), ("pwrite", FD, b"kvfs 1\n", 4090), ("close", FD),
                    ("open", own, rw), ("pwrite", FD, b"kk", (1 << 63) - 1),  # the kernel's
                    ("close", FD),
                    ("open", own, rw), ("pwrite", FD, b"kvfs 1\n" + b" " * 4089, 0),
                    ("close", FD),                              # 4096 bytes: not a descriptor
                    ("open", own, os.O_RDONLY), ("pread", FD, 1 << 30, (1 << 62)),
                    ("close", FD)) == \
        ["fd", -E.EFBIG, None, "fd", -E.EFBIG, None, "fd", -E.EINVAL, None,
         "fd", 4096, -E.EINVAL, "fd", b"", None]
    # Reading with a huge length returns the descriptor, nothing more.
    out = syscalls(("open", own, os.O_RDONLY), ("read", FD, 1 << 30), ("close", FD))
    d = descriptor.parse(out[1])
    assert (d.rights, d.tokens, out[2]) == ("r", len(mine), None)
    assert tokens_of(lip, own) == mine                          # left as it was
    still_serving(kvfs, lip, victim)


def test_bad_descriptors_are_einval_and_leave_the_file_as_it_was(kvfs, lip, victim):
    mine = lip.tokenize(TEXT)[:21]
    own = nobody_file(kvfs, lip, "own.kv", mine)
    target = nobody_file(kvfs, lip, "target.kv", mine[:3])
    wt = os.O_WRONLY | os.O_TRUNC

    def write_then_close(data: bytes) -> list:
        return syscalls(("open", target, wt), ("write", FD, data), ("close", FD))

    # Garbage: refused at write.
    assert write_then_close(b"\x00\xffgarbage") == ["fd", -E.EINVAL, None]
    # A partial descriptor, a forged capability: refused at close.
    assert write_then_close(b"kvfs 1\ncap 0123") == ["fd", 15, -E.EINVAL]
    forged = descriptor.Descriptor("5eed" * 8, "rw").encode()
    assert write_then_close(forged) == ["fd", len(forged), -E.EINVAL]
    # A revoked capability: nobody's own earlier open, released since.
    stale = syscalls(("open", own, os.O_RDONLY), ("read", FD, 4096), ("close", FD))[1]
    cap = descriptor.parse(stale).cap
    assert eventually(lambda: revoked(lip, cap))
    assert write_then_close(stale) == ["fd", len(stale), -E.EINVAL]
    # A live capability, but a descriptor for another model.
    with lip.kv_open(own) as kv:
        other = descriptor.Descriptor(kv.cap, "r", 21, 2, "Llama-3-70B").encode()
        assert write_then_close(other) == ["fd", len(other), -E.EINVAL]
    assert tokens_of(lip, target) == mine[:3]
    assert tokens_of(lip, own) == mine
    still_serving(kvfs, lip, victim)


def test_a_stale_descriptor_written_over_a_file_keeps_its_old_cache(kvfs, lip, victim):
    """`cat stale > b.kv` used to empty b.kv for good: the shell's O_TRUNC emptied it
    at the first close, then the descriptor was refused at the last."""
    m = kvfs.mount
    old = lip.tokenize(TEXT)[:29]
    sh("touch a.kv b.kv && chmod 644 a.kv", cwd=m)
    fill(lip, f"{m}/a.kv", lip.tokenize(TEXT)[40:45])
    fill(lip, f"{m}/b.kv", old)
    stale = os.path.join(kvfs.mount + ".stale")                # readable by nobody too
    with open(stale, "w") as f:
        f.write(sh("cat a.kv", cwd=m).stdout)
    os.chmod(stale, 0o644)
    try:
        _stale_descriptor_attacks(kvfs, lip, victim, stale, old)
    finally:
        os.unlink(stale)


def _stale_descriptor_attacks(kvfs, lip, victim, stale: str, old: list[int]) -> None:
    m = kvfs.mount
    assert eventually(lambda: revoked(lip, descriptor.parse(open(stale).read()).cap))
    held = lip.kv_open(f"{m}/b.kv", write=True)      # a LIP extending b.kv in place
    objects, free = lip.stats()["objects"], lip.stats()["pages_free"]
    for cmd in (f"cat {stale} > b.kv", f"cp {stale} b.kv", f"cat {stale} >> b.kv"):
        r = sh(cmd, cwd=m)
        assert r.returncode == 1 and "Invalid argument" in r.stderr, (cmd, r.stderr)
        assert xattr_int(f"{m}/b.kv", "tokens") == 29, cmd
        assert tokens_of(lip, f"{m}/b.kv") == old, cmd
        assert eventually(lambda: lip.stats()["objects"] == objects), cmd
    assert lip.stats()["pages_free"] == free
    # The very same cache is still b.kv's: the LIP's appends show through the name.
    more = lip.tokenize(" and more")
    lip.prefill(held, more)
    lip.kv_close(held)
    assert tokens_of(lip, f"{m}/b.kv") == old + more
    # The same as nobody, on nobody's own file, through the shell.
    mine = nobody_file(kvfs, lip, "mine.kv", old[:17])
    r = sh(f"cat {stale} > {mine}", user="nobody")
    assert r.returncode == 1 and "Invalid argument" in r.stderr, r.stderr
    assert tokens_of(lip, mine) == old[:17]
    # `: > file` still empties it, and a descriptor still forks.
    assert sh(f": > {mine} && cp {m}/a.kv {m}/copy.kv", user="nobody").returncode == 0
    assert tokens_of(lip, mine) == [] and xattr_int(f"{m}/copy.kv", "tokens") == 5
    still_serving(kvfs, lip, victim)


def test_new_files_are_private_and_grants_follow_the_mode(kvfs, lip, victim):
    m = kvfs.mount
    path = kvfs.path("victim.kv")
    st = os.stat(path)
    assert (stat.S_IMODE(st.st_mode), stat.S_IMODE(os.stat(m).st_mode)) == (0o600, 0o1777)
    assert sh("mkdir d", cwd=m).returncode == 0
    assert stat.S_IMODE(os.stat(f"{m}/d").st_mode) == 0o700
    # Another uid can neither open the cache nor read its attributes, nor remove it.
    assert syscalls(("open", path, os.O_RDONLY), ("getxattr", path, "user.kv.tokens"),
                    ("listdir", f"{m}/d"), ("unlink", path), ("rename", path, f"{m}/x"),
                    ("open", f"{m}/d/new.kv", os.O_WRONLY | os.O_CREAT, 0o600)) == \
        [-E.EACCES, -E.EACCES, -E.EACCES, -E.EPERM, -E.EPERM, -E.EACCES]
    # Shared on purpose: nobody reads it; that open's grant ends with that open, even
    # though root keeps the file open all along.
    os.chmod(path, 0o644)
    held = lip.kv_open(path)
    out = syscalls(("open", path, os.O_RDONLY), ("read", FD, 4096), ("close", FD))
    grant = descriptor.parse(out[1])
    assert (grant.rights, grant.tokens) == ("r", len(victim))
    assert eventually(lambda: revoked(lip, grant.cap))
    assert lip.kv_stat(held)["tokens"] == len(victim)
    # Not shared any more: a new open by another uid is refused by the kernel.
    os.chmod(path, 0o600)
    assert syscalls(("open", path, os.O_RDONLY)) == [-E.EACCES]
    lip.kv_close(held)
    # Read-only to others: no rw grant, no emptying, no replacing.
    os.chmod(path, 0o644)
    assert syscalls(("open", path, os.O_RDWR), ("open", path, os.O_WRONLY | os.O_TRUNC),
                    ("truncate", path, 0), ("setxattr", path, "user.kv.pin", b"1")) == \
        [-E.EACCES, -E.EACCES, -E.EACCES, -E.EACCES]
    still_serving(kvfs, lip, victim)


def test_a_revoked_grant_counts_only_for_a_writer_holding_its_own_open(kvfs, lip, victim):
    """cp's copy_file_range may splice another open's descriptor out of the shared page
    cache; that open may be released before cp closes the copy. kvfsd then forks from
    the writer's *own* open of the same file, and only if the writer has one."""
    m = kvfs.mount
    shared = kvfs.path("shared.kv")
    tokens = lip.tokenize(TEXT)[:23]
    sh("touch shared.kv && chmod 644 shared.kv", cwd=m)
    fill(lip, shared, tokens)
    mine = nobody_file(kvfs, lip, "mine.kv")
    with lip.kv_open(shared) as root_open:           # root's open, released at once
        released = descriptor.Descriptor(root_open.cap, "r").encode()
    assert eventually(lambda: revoked(lip, root_open.cap))
    wt = os.O_WRONLY | os.O_TRUNC
    # Without an open of shared.kv of its own: a revoked capability, refused.
    assert syscalls(("open", mine, wt), ("write", FD, released), ("close", FD)) == \
        ["fd", len(released), -E.EINVAL]
    # Another uid's open does not count either.
    with lip.kv_open(shared):
        assert syscalls(("open", mine, wt), ("write", FD, released), ("close", FD)) == \
            ["fd", len(released), -E.EINVAL]
    assert tokens_of(lip, mine) == []
    # Holding a readable open of shared.kv itself (as cp does): the fork is made.
    assert syscalls(("open", shared, os.O_RDONLY), ("open", mine, wt),
                    ("write", fd(1), released), ("close", fd(1)), ("close", fd(0))) == \
        ["fd", "fd", len(released), None, None]
    assert tokens_of(lip, mine) == tokens
    assert os.stat(mine).st_uid == NOBODY
    still_serving(kvfs, lip, victim)


def test_owners_and_modes_are_changed_only_as_posix_allows(kvfs, lip, victim):
    path = kvfs.path("victim.kv")
    own = nobody_file(kvfs, lip, "own.kv")
    assert syscalls(("chown", own, 0, 0), ("chown", path, NOBODY, NOBODY),
                    ("chmod", path, 0o666), ("chown", own, NOBODY, 0),
                    ("chown", own, NOBODY, NOBODY), ("chmod", own, 0o644),
                    ("utime", path, (1, 1))) == \
        [-E.EPERM, -E.EPERM, -E.EPERM, -E.EPERM, None, None, -E.EPERM]
    assert stat.S_IMODE(os.stat(own).st_mode) == 0o644
    st = os.stat(path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o600)
    still_serving(kvfs, lip, victim)


@pytest.mark.slow
def test_xattrs_are_few_and_short(kvfs, lip, victim):
    own = nobody_file(kvfs, lip, "own.kv")
    assert syscalls(("setxattr", own, "user.kv.pin", b"1"),
                    ("setxattr", own, "user.kv.ttl", b"86400")) == [None, None]
    ino = os.stat(own).st_ino                                    # committed before the reply
    assert saved_state(kvfs.state)["nodes"][ino]["xattrs"] == \
        {"dXNlci5rdi5waW4=": "MQ==", "dXNlci5rdi50dGw=": "ODY0MDA="}
    assert syscalls(("setxattr", own, "user.kv.evict", b"0"),      # an action: 1 only
                    ("setxattr", own, "user.kv.note", b"1"),
                    ("setxattr", own, "user.kv.tokens", b"5"),
                    ("removexattr", own, "user.kv.model"),
                    ("setxattr", own, "user.kv.ttl", b"9" * 65),
                    ("setxattr", own, "user.kv.pin", b"1" * 65536),
                    ("setxattr", own, "user.kv.pin", b"1" * 65537),
                    ("setxattr", own, "user.kv.pin", b"yes"),
                    ("setxattr", own, "user.app." + "n" * 60, b"1"),
                    ("setxattr", own, "user.app", b"v" * 65),
                    ("setxattr", own, "trusted.x", b"1"),       # the kernel's EPERM
                    ("setxattr", own, "security.x", b"1"),      # the kernel's EPERM
                    ("setxattr", kvfs.mount, "user.kv.pin", b"1"),   # the kernel's: sticky
                    ("mkdir", kvfs.path("mine")),
                    ("setxattr", kvfs.path("mine"), "user.kv.pin", b"1"),  # files only
                    ("getxattr", own, "user.kv.pin"), ("getxattr", own, "user.note")) == \
        [-E.EINVAL, -E.EOPNOTSUPP, -E.EPERM, -E.EPERM, -E.E2BIG, -E.E2BIG, -E.E2BIG,
         -E.EINVAL, -E.E2BIG, -E.E2BIG, -E.EPERM, -E.EPERM, -E.EPERM, None, -E.EOPNOTSUPP,
         b"1", -E.ENODATA]
    # 10,000 application attributes: the first 8 are kept, the rest get ENOSPC, and the
    # state holds exactly those 8 (each at most 64 + 64 bytes).
    steps = [("setxattr", own, f"user.flood{i}", b"v" * 64) for i in range(10_000)]
    assert syscalls(*steps) == [None] * 8 + [-E.ENOSPC] * (10_000 - 8)
    flood = sorted(f"user.flood{i}" for i in range(8))
    assert sorted(os.listxattr(own)) == sorted(
        ["user.kv.tokens", "user.kv.pages", "user.kv.bytes", "user.kv.model", "user.kv.tier",
         "user.kv.replica", "user.kv.pin", "user.kv.ttl"] + flood)
    row = saved_state(kvfs.state)["nodes"][ino]
    assert len(row["xattrs"]) == 10 and len(json.dumps(row)) < 2048
    # Refused requests write nothing.
    wal = os.path.join(kvfs.state, "namespace.db-wal")
    before = saved_state(kvfs.state), os.stat(wal).st_mtime_ns
    assert syscalls(*steps[8:1008]) == [-E.ENOSPC] * 1000
    time.sleep(1.0)      # not a timed assert: give a (wrong) delayed write the chance to land
    assert (saved_state(kvfs.state), os.stat(wal).st_mtime_ns) == before
    still_serving(kvfs, lip, victim)


def test_names_and_nodes_that_are_not_supported(kvfs, lip, victim):
    m = kvfs.mount
    own = nobody_file(kvfs, lip, "own.kv")
    assert syscalls(("mkfifo", f"{m}/fifo"),
                    ("mknod", f"{m}/dev", stat.S_IFCHR | 0o600, os.makedev(1, 3)),
                    ("mknod", f"{m}/sock", stat.S_IFSOCK | 0o600),
                    ("open", f"{m}/" + "n" * 256, os.O_WRONLY | os.O_CREAT, 0o600),
                    ("mkdir", f"{m}/" + "n" * 256),
                    ("rename", own, f"{m}/" + "n" * 256),
                    ("symlink", "x" * 4095, f"{m}/long"),       # PATH_MAX - 1: fine
                    ("symlink", "x" * 4096, f"{m}/longer"),
                    ("readlink", f"{m}/long"),
                    ("mkdir", f"{m}/nd"), ("mkdir", f"{m}/nd/sub"),
                    ("rename", f"{m}/nd", f"{m}/nd/sub/loop"),
                    ("link", f"{m}/nd", f"{m}/nd2"),
                    ("rename", f"{m}/nd/sub", f"{m}/nd/sub"),
                    # looking a name up: too long for any name, as tmpfs and ext4 answer
                    ("stat", f"{m}/" + "n" * 300), ("lstat", f"{m}/" + "n" * 256),
                    ("unlink", f"{m}/" + "n" * 256), ("rmdir", f"{m}/nd/" + "n" * 256),
                    ("stat", f"{m}/" + "n" * 255)) == \
        [-E.EPERM, -E.EPERM, -E.EPERM, -E.ENAMETOOLONG, -E.ENAMETOOLONG, -E.ENAMETOOLONG,
         None, -E.ENAMETOOLONG, "x" * 4095, None, None, -E.EINVAL, -E.EPERM, None,
         -E.ENAMETOOLONG, -E.ENAMETOOLONG, -E.ENAMETOOLONG, -E.ENAMETOOLONG, -E.ENOENT]
    # Deep nesting, one level at a time (each path stays short).
    depth = 300
    steps = [s for _ in range(depth) for s in (("mkdir", "d"), ("chdir", "d"))]
    out = syscalls(*steps, ("open", "deep.kv", os.O_WRONLY | os.O_CREAT, 0o600),
                   ("close", FD), cwd=m)
    assert out == [None] * (2 * depth) + ["fd", None]
    deep = os.path.join(m, *["d"] * depth, "deep.kv")
    assert os.stat(deep).st_uid == NOBODY and xattr_int(deep, "tokens") == 0
    still_serving(kvfs, lip, victim)


def test_truncate_append_and_direct_opens(kvfs, lip, victim):
    mine = lip.tokenize(TEXT)[:18]
    own = nobody_file(kvfs, lip, "own.kv", mine)
    size = os.stat(own).st_size          # the descriptor's length, more than 18
    assert syscalls(("truncate", own, 19), ("truncate", own, size),
                    ("truncate", own, 1 << 62), ("truncate", own, -1),
                    ("truncate", own, 18)) == \
        [-E.EINVAL, -E.EINVAL, -E.EINVAL, -E.EINVAL, None]
    assert tokens_of(lip, own) == mine
    assert syscalls(("truncate", own, 7)) == [None]
    assert tokens_of(lip, own) == mine[:7]
    # O_DIRECT reads the descriptor like any open; O_APPEND writes one like any open.
    out = syscalls(("open", own, os.O_RDONLY | os.O_DIRECT), ("read", FD, 4096),
                   ("close", FD))
    assert descriptor.parse(out[1]).tokens == 7
    with lip.kv_open(own) as kv:
        desc = descriptor.Descriptor(kv.cap).encode()
        copy = nobody_file(kvfs, lip, "copy.kv")
        assert syscalls(("open", copy, os.O_WRONLY | os.O_APPEND),
                        ("write", FD, desc[:9]), ("write", FD, desc[9:]),
                        ("close", FD)) == ["fd", 9, len(desc) - 9, None]
        assert syscalls(("open", copy, os.O_WRONLY | os.O_DIRECT | os.O_TRUNC),
                        ("write", FD, desc), ("close", FD)) == ["fd", len(desc), None]
    assert tokens_of(lip, copy) == mine[:7]
    assert syscalls(("truncate", own, 0)) == [None]
    assert tokens_of(lip, own) == []
    still_serving(kvfs, lip, victim)


# ---------------------------------------------------------------- bounds per uid

@pytest.fixture
def bounded(predd, lip, tmp_path):
    """kvfsd with a small bound on the names one uid may own."""
    k = start_kvfsd(predd.addr, str(tmp_path / "state"), "--names-per-uid", "20")
    try:
        yield k
    finally:
        code = finish(k)
    assert code == 0, k.log_text()[-2000:]


def test_names_per_uid_are_bounded_with_edquot(bounded, lip):
    m = bounded.mount
    creat = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    steps = [s for i in range(19) for s in (("open", f"{m}/f{i}.kv", creat, 0o600),
                                            ("close", FD))]
    assert syscalls(*steps, ("mkdir", f"{m}/d")) == ["fd", None] * 19 + [None]
    objects = lip.stats()["objects"]
    assert syscalls(("open", f"{m}/one-more.kv", creat, 0o600), ("mkdir", f"{m}/d2"),
                    ("symlink", "f0.kv", f"{m}/s"), ("link", f"{m}/f0.kv", f"{m}/f0b.kv"),
                    ("rename", f"{m}/f0.kv", f"{m}/d/f0.kv"),
                    ("open", f"{m}/f1.kv", os.O_WRONLY | os.O_TRUNC), ("close", FD)) == \
        [-E.EDQUOT, -E.EDQUOT, -E.EDQUOT, -E.EDQUOT, None, "fd", None]
    assert lip.stats()["objects"] == objects        # refused before predd made anything
    assert not os.path.exists(f"{m}/one-more.kv")
    # Root is not bounded; a removed name can be used again.
    assert sh("touch root1.kv root2.kv", cwd=m).returncode == 0
    assert syscalls(("unlink", f"{m}/d/f0.kv"),
                    ("open", f"{m}/again.kv", creat, 0o600), ("close", FD),
                    ("open", f"{m}/again2.kv", creat, 0o600)) == \
        [None, "fd", None, -E.EDQUOT]
    assert len(os.listdir(m)) == 18 + 1 + 1 + 2    # f1..f18, d, again, root1, root2
    report = lip.fsck()
    assert report["clean"], report["problems"]


# ---------------------------------------------------------------- predd's quota

PRIVATE_PREDD = ("--kv-pages", "64", "--max-step-tokens", "256", "--lease", "3",
                 "--uid-quota", "4")


@pytest.mark.slow
def test_caches_are_charged_to_the_user_and_edquot_reaches_the_syscall(tmp_path):
    """Files nobody makes (touch, cp) are charged to nobody, not to kvfsd's uid: with a
    4-page quota, nobody's second 3-page fork fails with EDQUOT at close."""
    import liblip as lip
    daemon = start_predd(str(tmp_path / "run"), *PRIVATE_PREDD)
    lip.connect(daemon.addr)
    k = None
    try:
        k = start_kvfsd(daemon.addr, str(tmp_path / "state"))
        m = k.mount
        assert sh("touch big.kv && chmod 644 big.kv", cwd=m).returncode == 0
        fill(lip, f"{m}/big.kv", lip.tokenize(TEXT)[:40])           # 3 pages
        assert xattr_int(f"{m}/big.kv", "pages") == 3
        r = sh(f"cp {m}/big.kv {m}/mine.kv", user="nobody")
        assert r.returncode == 0, r.stderr
        r = sh(f"cp {m}/big.kv {m}/mine2.kv", user="nobody")
        assert r.returncode == 1 and "Disk quota exceeded" in r.stderr, r.stderr
        assert (xattr_int(f"{m}/mine.kv", "tokens"), xattr_int(f"{m}/mine2.kv", "tokens")) \
            == (40, 0)
        assert os.stat(f"{m}/mine2.kv").st_uid == NOBODY
        # Root (kvfsd's operator) is not bounded by the uid quota.
        assert sh("cp big.kv root1.kv && cp big.kv root2.kv", cwd=m).returncode == 0
        assert k.proc.poll() is None and is_mounted(m)
        report = lip.fsck()
        assert report["clean"], report["problems"]
    finally:
        if k is not None:
            finish(k)
        lip.client().close()
        assert daemon.stop() == 0
