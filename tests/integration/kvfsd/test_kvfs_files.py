"""kvfsd on a real mount over the shared predd, driven with real coreutils: every row of
the shell table in docs/design.md §3, with exact token and page counts and exact errnos."""
import errno
import os
import stat
import time

import pytest

from symphony_protocol import descriptor
from tests.integration.kvfs_fixtures import (eventually, fill, revoked, saved_state, sh,
                                             syscalls, tiled_export, xattr_int)

TEXT = "The KV cache file system shows predd's caches as ordinary files. " * 6


def pages_free(lip) -> int:
    return lip.stats()["pages_free"]


def caps(lip) -> int:
    return lip.stats()["capabilities"]


def errno_of(fn, *args) -> int:
    with pytest.raises(OSError) as e:
        fn(*args)
    return e.value.errno


def test_mount_options_and_root(kvfs):
    with open("/proc/mounts") as f:
        line = next(ln for ln in f if ln.split()[1] == kvfs.mount)
    fstype, options = line.split()[2], line.split()[3].split(",")
    assert fstype == "fuse.kvfs"
    assert "default_permissions" in options and "allow_other" in options
    st = os.stat(kvfs.mount)
    assert stat.S_IMODE(st.st_mode) == 0o1777 and st.st_uid == 0


def test_touch_makes_an_empty_cache(kvfs, lip):
    before = lip.stats()
    r = sh("touch a.kv", cwd=kvfs.mount)
    assert r.returncode == 0, r.stderr
    path = kvfs.path("a.kv")
    assert stat.S_ISREG(os.stat(path).st_mode)
    assert (xattr_int(path, "tokens"), xattr_int(path, "pages"), xattr_int(path, "bytes")) \
        == (0, 0, 0)
    after = lip.stats()
    assert after["objects"] == before["objects"] + 1
    assert after["pages_free"] == before["pages_free"]


def test_cat_shows_a_descriptor_with_a_fresh_capability_per_open(kvfs, lip):
    sh("touch a.kv", cwd=kvfs.mount)           # opened write-only: no capability granted
    baseline = caps(lip)
    tokens = lip.tokenize(TEXT)
    fill(lip, kvfs.path("a.kv"), tokens)
    first = sh("cat a.kv", cwd=kvfs.mount).stdout
    second = sh("cat a.kv", cwd=kvfs.mount).stdout
    d1, d2 = descriptor.parse(first), descriptor.parse(second)
    assert first.startswith("kvfs 1\n")
    assert d1.cap != d2.cap
    assert (d1.rights, d1.tokens, d1.pages) == ("r", len(tokens), -(-len(tokens) // 16))
    assert d1.model == lip.info()["model"]
    # Each open's capability is revoked when that open is released.
    assert eventually(lambda: caps(lip) == baseline), lip.stats()
    with pytest.raises(lip.LipError) as e:
        lip.kv_stat(lip.KV.from_capability(d1.cap))
    assert e.value.code == "EBADF"
    # While a file is open its capability works; opened for writing it is rw.
    ro = lip.kv_open(kvfs.path("a.kv"))
    rw = lip.kv_open(kvfs.path("a.kv"), write=True)
    assert (ro.rights, rw.rights) == ("r", "rw")
    assert lip.kv_stat(ro)["tokens"] == len(tokens)
    with pytest.raises(lip.LipError) as e:
        lip.pred(ro, tokens[:1])
    assert e.value.code == "EACCES"
    lip.kv_close(ro)
    lip.kv_close(rw)
    assert eventually(lambda: caps(lip) == baseline)


def test_a_grant_ends_at_the_last_close_of_its_open_not_at_each_close(kvfs, lip):
    """The release of an open (its last close(2); a dup keeps it) ends its grant, and
    grants made from it; a fork made from it is the program's own and stays."""
    sh("touch a.kv", cwd=kvfs.mount)
    tokens = lip.tokenize(TEXT)[:5]
    fill(lip, kvfs.path("a.kv"), tokens)
    fd = os.open(kvfs.path("a.kv"), os.O_RDONLY)
    dup = os.dup(fd)
    held = lip.KV.from_capability(descriptor.parse(os.pread(fd, 4096, 0)).cap)
    regrant = lip.KV.from_capability(lip.client().call("kv_grant", cap=held.cap)["cap"])
    fork = lip.kv_fork(held)
    os.close(fd)
    # A later open, closed at once: once its grant is gone, a release of the first
    # open (sent at the first close(2), had there been one) would have reached kvfsd.
    probe = descriptor.parse(sh("cat a.kv", cwd=kvfs.mount).stdout).cap
    assert eventually(lambda: revoked(lip, probe))
    assert lip.kv_stat(held)["tokens"] == lip.kv_stat(regrant)["tokens"] == len(tokens)
    os.close(dup)
    assert eventually(lambda: revoked(lip, held.cap) and revoked(lip, regrant.cap))
    assert lip.kv_tokens(fork) == tokens
    lip.kv_close(fork)


def test_cp_forks_copy_on_write(kvfs, lip):
    sh("touch a.kv", cwd=kvfs.mount)
    tokens = lip.tokenize(TEXT)[:20]              # 2 pages, the second partly filled
    fill(lip, kvfs.path("a.kv"), tokens)
    free0 = pages_free(lip)
    r = sh("cp a.kv b.kv", cwd=kvfs.mount)
    assert r.returncode == 0, r.stderr
    b = kvfs.path("b.kv")
    assert xattr_int(b, "tokens") == 20 and xattr_int(b, "pages") == 2
    assert pages_free(lip) == free0               # every page shared
    kb = lip.kv_open(b, write=True)
    assert lip.kv_tokens(kb) == tokens
    lip.pred(kb, [tokens[0]])                     # the shared partial page is copied
    lip.kv_close(kb)
    assert pages_free(lip) == free0 - 1
    assert xattr_int(b, "tokens") == 21 and xattr_int(kvfs.path("a.kv"), "tokens") == 20
    ka = lip.kv_open(kvfs.path("a.kv"))
    assert lip.kv_tokens(ka) == tokens
    lip.kv_close(ka)


def test_cp_over_an_existing_file_replaces_its_cache(kvfs, lip):
    sh("touch a.kv b.kv", cwd=kvfs.mount)
    fill(lip, kvfs.path("a.kv"), lip.tokenize(TEXT)[:40])     # 3 pages
    fill(lip, kvfs.path("b.kv"), lip.tokenize("something else entirely"))   # 1 page
    ino = os.stat(kvfs.path("b.kv")).st_ino
    free0 = pages_free(lip)
    r = sh("cp a.kv b.kv", cwd=kvfs.mount)
    assert r.returncode == 0, r.stderr
    assert os.stat(kvfs.path("b.kv")).st_ino == ino
    assert xattr_int(kvfs.path("b.kv"), "tokens") == 40
    assert eventually(lambda: pages_free(lip) == free0 + 1)   # b's old page came back


@pytest.mark.slow
def test_fork_time_does_not_grow_with_the_cache(kvfs, lip):
    short = lip.kv_create()
    lip.prefill(short, lip.tokenize(TEXT)[:16])
    long_ = lip.kv_import(tiled_export(lip.kv_export(short), 256))
    assert lip.kv_stat(long_)["tokens"] == 4096 and lip.kv_stat(long_)["pages"] == 256
    lip.kv_save(short, kvfs.path("short.kv"))
    lip.kv_save(long_, kvfs.path("long.kv"))
    lip.kv_free(short)
    lip.kv_free(long_)
    assert xattr_int(kvfs.path("long.kv"), "tokens") == 4096

    def cp_time(src: str, n: int) -> float:
        times = []
        for i in range(n):
            free = pages_free(lip)
            t = time.perf_counter()
            r = sh(f"cp {src}.kv {src}{i}.kv", cwd=kvfs.mount)
            times.append(time.perf_counter() - t)
            assert r.returncode == 0, r.stderr
            assert free - pages_free(lip) <= 1       # at most one page per fork
        return sorted(times)[n // 2]

    t_short, t_long = cp_time("short", 5), cp_time("long", 5)
    print(f"\ncp fork: 16 tokens {t_short * 1e3:.1f} ms, 4096 tokens {t_long * 1e3:.1f} ms")
    assert t_long < 3 * t_short + 0.05
    # The fork shares all 256 full pages: appending allocates exactly one new page.
    free = pages_free(lip)
    k = lip.kv_open(kvfs.path("long0.kv"), write=True)
    lip.pred(k, [1])
    lip.kv_close(k)
    assert free - pages_free(lip) == 1


def test_garbage_is_refused_with_einval_and_the_file_is_left_as_it_was(kvfs, lip):
    sh("touch a.kv", cwd=kvfs.mount)
    path = kvfs.path("a.kv")
    fill(lip, path, lip.tokenize(TEXT)[:20])
    free0 = pages_free(lip)
    r = sh("echo garbage > a.kv", cwd=kvfs.mount)
    assert r.returncode == 1 and "Invalid argument" in r.stderr
    assert eventually(lambda: pages_free(lip) == free0)
    assert xattr_int(path, "tokens") == 20

    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    assert errno_of(os.write, fd, b"not a descriptor") == errno.EINVAL
    os.close(fd)
    # Starts like a descriptor but is not one: refused at close (flush).
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, b"kvfs 1\ncap nothex\n")
    assert errno_of(os.close, fd) == errno.EINVAL
    # A well-formed descriptor with a capability predd never issued.
    forged = descriptor.Descriptor("0123456789abcdef" * 2, "rw").encode()
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    os.write(fd, forged)
    assert errno_of(os.close, fd) == errno.EINVAL
    # Too long to be a descriptor: past the 4096-byte limit.
    fd = os.open(path, os.O_WRONLY)
    assert errno_of(os.write, fd, b"kvfs 1\n" + b"x" * 5000) == errno.EFBIG
    os.close(fd)
    assert xattr_int(path, "tokens") == 20
    assert eventually(lambda: pages_free(lip) == free0)


def test_truncating_empties_the_cache(kvfs, lip):
    sh("touch a.kv b.kv", cwd=kvfs.mount)
    fill(lip, kvfs.path("a.kv"), lip.tokenize(TEXT)[:40])
    fill(lip, kvfs.path("b.kv"), lip.tokenize(TEXT)[:40])
    free0 = pages_free(lip)
    r = sh(": > a.kv", cwd=kvfs.mount)
    assert r.returncode == 0, r.stderr
    assert xattr_int(kvfs.path("a.kv"), "tokens") == 0
    assert xattr_int(kvfs.path("a.kv"), "pages") == 0
    assert eventually(lambda: pages_free(lip) == free0 + 3)
    r = sh("truncate -s 0 b.kv", cwd=kvfs.mount)
    assert r.returncode == 0, r.stderr
    assert xattr_int(kvfs.path("b.kv"), "tokens") == 0
    assert eventually(lambda: pages_free(lip) == free0 + 6)
    r = sh("truncate -s 7 b.kv", cwd=kvfs.mount)
    assert r.returncode == 1 and "Invalid argument" in r.stderr


def test_truncate_to_n_keeps_the_first_n_entries(kvfs, lip):
    """`truncate -s N` counts entries, not bytes: the cache keeps its first N (predd
    kv_truncate, in place, so an open capability sees it too); past its length EINVAL;
    st_size stays the descriptor's length."""
    m = kvfs.mount
    tokens = lip.tokenize(TEXT)[:40]
    sh("touch a.kv", cwd=m)
    fill(lip, kvfs.path("a.kv"), tokens)
    held = lip.kv_open(kvfs.path("a.kv"), write=True)
    free0 = pages_free(lip)
    r = sh("truncate -s 3 a.kv", cwd=m)
    assert r.returncode == 0, r.stderr
    assert xattr_int(kvfs.path("a.kv"), "tokens") == 3
    assert xattr_int(kvfs.path("a.kv"), "pages") == 1
    assert lip.kv_tokens(held) == tokens[:3]              # the same cache, cut
    assert pages_free(lip) == free0 + 2                   # 40 entries: 3 pages; 3: 1
    lip.kv_close(held)
    model = lip.info()["model"]
    assert os.stat(kvfs.path("a.kv")).st_size == \
        len(descriptor.render("0" * 32, "r", 3, 1, model, kvfs.addr).encode())
    r = sh("truncate -s 4 a.kv", cwd=m)
    assert r.returncode == 1 and "Invalid argument" in r.stderr
    r = sh("truncate -s 3 a.kv && truncate -s +0 a.kv", cwd=m)   # +0: st_size, > 3
    assert r.returncode == 1 and "Invalid argument" in r.stderr
    with lip.kv_open(kvfs.path("a.kv")) as kv:
        assert lip.kv_tokens(kv) == tokens[:3]
    # A file nobody may write: the kernel refuses (the open of truncate(1), truncate(2)).
    assert sh("chmod 644 a.kv", cwd=m).returncode == 0
    r = sh(f"truncate -s 1 {kvfs.path('a.kv')}", user="nobody")
    assert r.returncode == 1 and "Permission denied" in r.stderr, r.stderr
    assert syscalls(("truncate", kvfs.path("a.kv"), 1)) == [-errno.EACCES]
    assert xattr_int(kvfs.path("a.kv"), "tokens") == 3


def test_rm_frees_the_cache_after_the_last_name_and_the_last_open(kvfs, lip):
    sh("touch a.kv", cwd=kvfs.mount)
    free0 = pages_free(lip)
    fill(lip, kvfs.path("a.kv"), lip.tokenize(TEXT)[:40])
    assert pages_free(lip) == free0 - 3
    objects = lip.stats()["objects"]
    assert sh("ln a.kv c.kv && rm a.kv", cwd=kvfs.mount).returncode == 0
    assert pages_free(lip) == free0 - 3                        # c.kv still names it
    held = lip.kv_open(kvfs.path("c.kv"))
    assert sh("rm c.kv", cwd=kvfs.mount).returncode == 0
    assert not os.path.exists(kvfs.path("c.kv"))
    assert pages_free(lip) == free0 - 3                        # still open
    assert lip.kv_stat(held)["tokens"] == 40
    lip.kv_close(held)
    assert eventually(lambda: pages_free(lip) == free0)
    assert lip.stats()["objects"] == objects - 1


def test_ln_mv_mkdir_rmdir_behave_as_on_a_local_fs(kvfs, lip):
    m = kvfs.mount
    assert sh("touch a.kv && ln a.kv b.kv && mkdir -p d/e", cwd=m).returncode == 0
    a, b = os.stat(f"{m}/a.kv"), os.stat(f"{m}/b.kv")
    assert a.st_ino == b.st_ino and a.st_nlink == 2
    assert os.stat(f"{m}/d").st_nlink == 3
    fill(lip, f"{m}/a.kv", lip.tokenize(TEXT)[:5])
    assert xattr_int(f"{m}/b.kv", "tokens") == 5
    assert sh("mv b.kv d/e/moved.kv", cwd=m).returncode == 0
    assert sorted(os.listdir(m)) == ["a.kv", "d"]
    assert xattr_int(f"{m}/d/e/moved.kv", "tokens") == 5
    r = sh("rmdir d", cwd=m)
    assert r.returncode == 1 and "Directory not empty" in r.stderr
    r = sh("mv d d/e/", cwd=m)
    assert r.returncode == 1 and "to a subdirectory of itself" in r.stderr
    assert errno_of(os.rename, f"{m}/d", f"{m}/d/e/x") == errno.EINVAL
    assert sh("ln -s d/e/moved.kv sym && cat sym", cwd=m).stdout.startswith("kvfs 1\n")
    assert os.readlink(f"{m}/sym") == "d/e/moved.kv"
    assert errno_of(os.link, f"{m}/d", f"{m}/d2") == errno.EPERM
    # mv over an existing file replaces it; the replaced cache is freed.
    sh("touch c.kv", cwd=m)
    fill(lip, f"{m}/c.kv", lip.tokenize(TEXT)[:40])
    free = pages_free(lip)
    assert sh("mv c.kv a.kv", cwd=m).returncode == 0
    assert xattr_int(f"{m}/a.kv", "tokens") == 40
    assert eventually(lambda: pages_free(lip) == free)          # a's page went, still 1 link
    assert xattr_int(f"{m}/d/e/moved.kv", "tokens") == 5        # the old a.kv, by its link
    assert sh("rm -r d sym && ls -A", cwd=m).stdout.split() == ["a.kv"]
    assert os.stat(m).st_nlink == 2


def test_chmod_and_chown(kvfs):
    m = kvfs.mount
    assert sh("touch a.kv && chmod 640 a.kv && chown nobody:nogroup a.kv", cwd=m).returncode == 0
    st = os.stat(f"{m}/a.kv")
    assert stat.S_IMODE(st.st_mode) == 0o640 and (st.st_uid, st.st_gid) == (65534, 65534)
    assert sh("mkdir d && chmod 700 d", cwd=m).returncode == 0
    assert stat.S_IMODE(os.stat(f"{m}/d").st_mode) == 0o700
    # New files and directories are private whatever the umask; umask still narrows.
    assert sh("umask 000 && touch p.kv && mkdir pd", cwd=m).returncode == 0
    assert stat.S_IMODE(os.stat(f"{m}/p.kv").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(f"{m}/pd").st_mode) == 0o700
    assert sh("umask 277 && touch q.kv", cwd=m).returncode == 0
    assert stat.S_IMODE(os.stat(f"{m}/q.kv").st_mode) == 0o400


def test_another_uid_cannot_read_a_private_cache(kvfs, lip):
    m = kvfs.mount
    sh("touch secret.kv open.kv && chmod 600 secret.kv && chmod 644 open.kv", cwd=m)
    fill(lip, f"{m}/secret.kv", lip.tokenize(TEXT)[:8])
    r = sh(f"cat {m}/secret.kv", user="nobody")
    assert r.returncode == 1 and "Permission denied" in r.stderr and "cap" not in r.stdout
    r = sh(f"cp {m}/secret.kv /tmp/kvfs-stolen-$$.kv", user="nobody")
    assert r.returncode == 1 and "Permission denied" in r.stderr
    r = sh(f"getfattr -n user.kv.tokens {m}/secret.kv", user="nobody")
    assert r.returncode == 1 and "Permission denied" in r.stderr
    # The same path with a readable mode works: the refusal above is the mode's.
    r = sh(f"cat {m}/open.kv", user="nobody")
    assert r.returncode == 0 and descriptor.parse(r.stdout).rights == "r"
    # Writing needs write permission; the sticky root keeps others' names safe.
    r = sh(f"echo x > {m}/open.kv", user="nobody")
    assert r.returncode == 1 and "Permission denied" in r.stderr
    r = sh(f"rm -f {m}/secret.kv", user="nobody")
    assert r.returncode == 1 and "Operation not permitted" in r.stderr
    r = sh(f"touch {m}/mine.kv && stat -c %U {m}/mine.kv", user="nobody")
    assert r.returncode == 0 and r.stdout.strip() == "nobody"
    # The state directory, which holds the persistent capabilities, is root's alone.
    assert stat.S_IMODE(os.stat(kvfs.state).st_mode) == 0o700
    ns_file = os.path.join(kvfs.state, "namespace.db")
    assert stat.S_IMODE(os.stat(ns_file).st_mode) == 0o600
    r = sh(f"cat {ns_file}", user="nobody")
    assert r.returncode == 1 and "Permission denied" in r.stderr


def test_ls_du_df_show_descriptor_size_and_real_memory(kvfs, lip):
    m = kvfs.mount
    sh("touch a.kv", cwd=m)
    fill(lip, f"{m}/a.kv", lip.tokenize(TEXT)[:40])
    info = lip.info()
    st = os.stat(f"{m}/a.kv")
    assert st.st_size == len(sh("cat a.kv", cwd=m).stdout)
    assert st.st_blocks * 512 == 3 * info["bytes_per_page"]
    assert sh("du -B1 a.kv", cwd=m).stdout.split()[0] == str(3 * info["bytes_per_page"])
    assert sh("ls -l a.kv", cwd=m).stdout.split()[4] == str(st.st_size)
    stats = lip.stats()
    vfs = os.statvfs(m)
    assert vfs.f_frsize == info["bytes_per_page"]
    assert vfs.f_blocks == info["pages_total"]
    assert vfs.f_bfree == stats["pages_free"] == vfs.f_bavail
    out = sh("df -B1 --output=size,used,avail .", cwd=m).stdout.split()
    bpp = info["bytes_per_page"]
    assert out[-3:] == [str(info["pages_total"] * bpp),
                        str((info["pages_total"] - stats["pages_free"]) * bpp),
                        str(stats["pages_free"] * bpp)]


def test_mtime_moves_when_the_cache_grows(kvfs, lip):
    m = kvfs.mount
    sh("touch -d '2001-01-01' a.kv", cwd=m)
    assert time.gmtime(os.stat(f"{m}/a.kv").st_mtime).tm_year == 2001
    assert time.gmtime(os.stat(f"{m}/a.kv").st_mtime).tm_year == 2001   # unchanged: no growth
    kv = lip.kv_open(f"{m}/a.kv", write=True)
    lip.prefill(kv, lip.tokenize(TEXT)[:4])
    assert abs(os.stat(f"{m}/a.kv").st_mtime - time.time()) < 5
    lip.kv_close(kv)


@pytest.mark.slow
def test_stat_does_not_wait_behind_a_long_generate(kvfs, lip):
    import threading
    m = kvfs.mount
    sh("touch a.kv", cwd=m)
    tokens = lip.tokenize(TEXT)[:10]
    fill(lip, f"{m}/a.kv", tokens)
    kv = lip.kv_open(f"{m}/a.kv", write=True)
    worker = threading.Thread(target=lip.generate, args=(kv, [tokens[0]]),
                              kwargs={"max_tokens": 16, "ignore_eos": True})
    worker.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    os.stat(f"{m}/a.kv")                      # predd defers its kv_stat behind the call
    took = time.monotonic() - t0
    worker.join()
    lip.kv_close(kv)
    assert took < 1.5
    assert eventually(lambda: xattr_int(f"{m}/a.kv", "tokens") == 10 + 16)


def test_xattrs(kvfs, lip):
    m = kvfs.mount
    sh("touch a.kv", cwd=m)
    fill(lip, f"{m}/a.kv", lip.tokenize(TEXT)[:20])
    info = lip.info()
    out = sh("getfattr -d a.kv", cwd=m).stdout
    for line in ('user.kv.tokens="20"', 'user.kv.pages="2"',
                 f'user.kv.bytes="{2 * info["bytes_per_page"]}"',
                 f'user.kv.model="{info["model"]}"', 'user.kv.tier="device"'):
        assert line in out, out
    r = sh("setfattr -n user.kv.tokens -v 5 a.kv", cwd=m)
    assert r.returncode == 1 and "Operation not permitted" in r.stderr
    assert errno_of(os.removexattr, f"{m}/a.kv", "user.kv.model") == errno.EPERM
    assert sh("setfattr -n user.kv.pin -v 1 a.kv && setfattr -n user.kv.ttl -v 3600 a.kv",
              cwd=m).returncode == 0
    assert os.getxattr(f"{m}/a.kv", "user.kv.pin") == b"1"
    assert os.getxattr(f"{m}/a.kv", "user.kv.ttl") == b"3600"
    assert sh("setfattr -n user.note -v hello a.kv", cwd=m).returncode == 0   # the app's
    assert os.getxattr(f"{m}/a.kv", "user.note") == b"hello"
    r = sh("setfattr -n user.kv.note -v hello a.kv", cwd=m)
    assert r.returncode == 1 and "Operation not supported" in r.stderr
    r = sh("setfattr -n user.kv.pin -v maybe a.kv", cwd=m)
    assert r.returncode == 1 and "Invalid argument" in r.stderr
    assert errno_of(os.getxattr, f"{m}/a.kv", "user.absent") == errno.ENODATA
    names = os.listxattr(f"{m}/a.kv")
    assert set(names) == {"user.kv.tokens", "user.kv.pages", "user.kv.bytes", "user.kv.model",
                          "user.kv.tier", "user.kv.replica", "user.kv.pin", "user.kv.ttl",
                          "user.note"}
    assert os.getxattr(f"{m}/a.kv", "user.kv.replica") == kvfs.addr.encode()
    ino = os.stat(f"{m}/a.kv").st_ino
    saved = saved_state(kvfs.state)["nodes"][ino]                 # recorded in the state
    assert saved["xattrs"] == {"dXNlci5rdi5waW4=": "MQ==", "dXNlci5rdi50dGw=": "MzYwMA==",
                               "dXNlci5ub3Rl": "aGVsbG8="}


def test_fsync_writes_a_snapshot_into_the_state_dir(kvfs, lip):
    m = kvfs.mount
    sh("touch a.kv", cwd=m)
    fill(lip, f"{m}/a.kv", lip.tokenize(TEXT)[:20])
    ino = os.stat(f"{m}/a.kv").st_ino
    r = sh("sync a.kv", cwd=m)
    assert r.returncode == 0, r.stderr
    snap = os.path.join(kvfs.state, "snapshots", f"{ino}.kvx")
    assert os.path.getsize(snap) > 20 * lip.info()["bytes_per_page"] // 16
    assert stat.S_IMODE(os.stat(snap).st_mode) == 0o600
    assert saved_state(kvfs.state)["nodes"][ino]["snapshot"] == f"{ino}.kvx"
    assert sh("rm a.kv", cwd=m).returncode == 0
    assert eventually(lambda: not os.path.exists(snap))
