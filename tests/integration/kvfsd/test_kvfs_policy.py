"""Memory policy through xattrs, on a real mount with real coreutils: `user.kv.ttl`
removes a file left quiet for its ttl (kvfsd's own timer, any predd); `user.kv.pin`,
`user.kv.evict` and `user.kv.tier` are carried out by predd's `kv_policy` and
`kv_stat` — those tests skip, saying so, on a predd without memory tiers
(no `host_pages` in its info)."""
import errno
import os
import time

import pytest

from tests.conftest import start_predd
from tests.integration.kvfs_fixtures import (FD, NOBODY, eventually, fill, finish,
                                             saved_state, sh, start_kvfsd, syscalls,
                                             xattr_int)

TEXT = "Memory follows the program's intent: pin what you need, evict what you do not. " * 4
EXPIRY_BOUND = 20.0       # generous: a ttl of 1 s is acted on within ~2 s


def objects(lip) -> int:
    return lip.stats()["objects"]


# ---------------------------------------------------------------- user.kv.ttl

def test_ttl_removes_only_the_quiet_file_with_every_name(kvfs, lip):
    m = kvfs.mount
    os.mkdir(f"{m}/sub")
    sh("touch a.kv b.kv", cwd=m)
    fill(lip, f"{m}/a.kv", lip.tokenize(TEXT)[:40])
    assert sh("ln a.kv sub/a2.kv", cwd=m).returncode == 0
    free0, objects0 = lip.stats()["pages_free"], objects(lip)
    t0 = time.monotonic()
    assert sh("setfattr -n user.kv.ttl -v 1 a.kv", cwd=m).returncode == 0
    assert eventually(lambda: not os.path.exists(f"{m}/a.kv"), timeout=EXPIRY_BOUND)
    assert not os.path.exists(f"{m}/sub/a2.kv")             # every name, as rm of each
    assert eventually(lambda: objects(lip) == objects0 - 1)
    assert lip.stats()["pages_free"] == free0 + 3             # its 40 entries' pages
    # kvfsd logs the removal after the names are gone (kvfsd/expiry.py `_remove`)
    assert eventually(lambda: "/a.kv: removed (user.kv.ttl 1 s ran out)" in kvfs.log_text())
    entries = saved_state(kvfs.state)["entries"]
    assert {name for _, name in entries} == {b"b.kv", b"sub"}
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))   # b.kv, without a ttl, stays
    assert sorted(os.listdir(m)) == ["b.kv", "sub"] and os.listdir(f"{m}/sub") == []


def test_ttl_spares_an_open_file_until_its_last_close(kvfs, lip):
    m = kvfs.mount
    sh("touch held.kv", cwd=m)
    fd = os.open(f"{m}/held.kv", os.O_RDONLY)                # an open: a grant, too
    assert sh("setfattr -n user.kv.ttl -v 1 held.kv", cwd=m).returncode == 0
    time.sleep(3.0)        # not a timed assert: three checks go by while it is open
    assert os.path.exists(f"{m}/held.kv")
    assert xattr_int(f"{m}/held.kv", "tokens") == 0
    os.close(fd)
    assert eventually(lambda: not os.path.exists(f"{m}/held.kv"), timeout=EXPIRY_BOUND)


def test_a_ttl_outlives_a_kvfsd_restart_and_can_be_taken_back(kvfs, lip):
    m = kvfs.mount
    sh("touch a.kv b.kv", cwd=m)
    assert sh("setfattr -n user.kv.ttl -v 2 a.kv && setfattr -n user.kv.ttl -v 1 b.kv "
              "&& setfattr -x user.kv.ttl b.kv", cwd=m).returncode == 0
    kvfs.restart()                      # the new kvfsd finds a.kv's ttl in its state
    assert eventually(lambda: not os.path.exists(f"{m}/a.kv"), timeout=EXPIRY_BOUND)
    time.sleep(2.0)        # not a timed assert: b.kv's ttl was removed, it must stay
    assert os.listdir(m) == ["b.kv"]


def test_tier_reads_predd_or_device(kvfs, lip):
    """kv_stat's `tier`; "device" from a predd that does not report one."""
    sh("touch a.kv", cwd=kvfs.mount)
    fill(lip, kvfs.path("a.kv"), lip.tokenize(TEXT)[:20])
    with lip.kv_open(kvfs.path("a.kv")) as kv:
        want = lip.kv_stat(kv).get("tier", "device")
    assert want == "device"                                   # fresh: on the device
    assert os.getxattr(kvfs.path("a.kv"), "user.kv.tier") == b"device"


# ---------------------------------------------------------------- pin and evict (tiers)

@pytest.fixture
def tiered(predd, tmp_path):
    """A predd of the test's own with a host tier and a pin quota of 4 pages, at one
    address across restarts, and a kvfsd over it. Skips on a predd without tiers."""
    import liblip
    liblip.connect(predd.addr)
    if "host_pages" not in liblip.info():
        pytest.skip("predd has no memory tiers (info lacks host_pages): needs kv_policy")

    class Own:
        rundir = str(tmp_path / "run")
        daemon = None
        kvfs = None

        def start_predd(self):
            self.daemon = start_predd(self.rundir, "--kv-pages", "64", "--host-pages", "64",
                                      "--pin-quota", "4", "--lease", "3")
            liblip.connect(self.daemon.addr, dead_after_s=60)

    own = Own()
    try:
        own.start_predd()
        own.kvfs = start_kvfsd(own.daemon.addr, str(tmp_path / "state"))
        yield own
        report = liblip.fsck()
        assert report["clean"], report["problems"]
    finally:
        alive = own.daemon is not None and own.daemon.proc.poll() is None
        if own.kvfs is not None:
            finish(own.kvfs, clear=alive)
        liblip.client().close()
        if own.daemon is not None:
            own.daemon.stop()
        liblip.connect(predd.addr)


def pinned(lip, path: str) -> bool:
    with lip.kv_open(path) as kv:
        return bool(lip.kv_stat(kv)["pinned"])


def nobody_file(k, lip, name: str, n_tokens: int) -> str:
    path = k.path(name)
    assert syscalls(("open", path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644),
                    ("close", FD)) == ["fd", None]
    fill(lip, path, lip.tokenize(TEXT)[:n_tokens])
    return path


@pytest.mark.slow
def test_pin_goes_to_predd_with_its_quota_and_comes_back_after_a_restart(tiered):
    import liblip as lip
    k = tiered.kvfs
    m = k.mount
    big = nobody_file(k, lip, "big.kv", 80)          # 5 pages, over nobody's quota of 4
    small = nobody_file(k, lip, "small.kv", 20)      # 2 pages
    r = sh("setfattr -n user.kv.pin -v 1 big.kv", cwd=m, user="nobody")
    assert r.returncode == 1 and "Disk quota exceeded" in r.stderr, r.stderr
    assert syscalls(("setxattr", big, "user.kv.pin", b"1"),
                    ("getxattr", big, "user.kv.pin")) == [-errno.EDQUOT, -errno.ENODATA]
    assert not pinned(lip, big)
    assert sh("setfattr -n user.kv.pin -v 1 small.kv", cwd=m, user="nobody").returncode == 0
    assert os.getxattr(small, "user.kv.pin") == b"1" and pinned(lip, small)
    assert sh("setfattr -n user.kv.pin -v 0 small.kv", cwd=m, user="nobody").returncode == 0
    assert not pinned(lip, small)
    assert sh("setfattr -n user.kv.pin -v 1 small.kv", cwd=m, user="nobody").returncode == 0
    # The pin belongs to the file: a fork written into it must be pinned too (5 pages:
    # over the quota), so cp fails and small.kv keeps its cache, pinned.
    r = sh("cp big.kv small.kv", cwd=m, user="nobody")
    assert r.returncode == 1 and "Disk quota exceeded" in r.stderr, r.stderr
    assert xattr_int(small, "tokens") == 20 and pinned(lip, small)
    # Pinned: it cannot be evicted.
    r = sh("setfattr -n user.kv.evict -v 1 small.kv", cwd=m, user="nobody")
    assert r.returncode == 1 and "Device or resource busy" in r.stderr, r.stderr
    # predd restarts: small.kv comes back from its snapshot, pinned again.
    assert sh("sync small.kv", cwd=m).returncode == 0
    tiered.daemon.proc.kill()
    tiered.daemon.proc.wait()
    log_from = len(k.log_text())
    tiered.start_predd()
    assert eventually(lambda: "/small.kv: restored" in k.log_text()[log_from:], timeout=30)
    assert xattr_int(small, "tokens") == 20 and pinned(lip, small)
    assert os.getxattr(small, "user.kv.pin") == b"1"
    # Unpinned by removing the attribute.
    assert sh("setfattr -x user.kv.pin small.kv", cwd=m, user="nobody").returncode == 0
    assert not pinned(lip, small)
    assert os.stat(small).st_uid == NOBODY


@pytest.mark.slow
def test_evict_moves_a_cache_down_and_is_not_stored(tiered):
    import liblip as lip
    k = tiered.kvfs
    m = k.mount
    sh("touch a.kv", cwd=m)
    tokens = lip.tokenize(TEXT)[:40]
    fill(lip, k.path("a.kv"), tokens)
    assert os.getxattr(k.path("a.kv"), "user.kv.tier") == b"device"
    assert sh("setfattr -n user.kv.evict -v 1 a.kv", cwd=m).returncode == 0
    assert os.getxattr(k.path("a.kv"), "user.kv.tier") in (b"host", b"disk")
    r = sh("getfattr -n user.kv.evict a.kv", cwd=m)
    assert r.returncode == 1 and "No such attribute" in r.stderr
    assert "user.kv.evict" not in os.listxattr(k.path("a.kv"))
    r = sh("setfattr -n user.kv.evict -v 0 a.kv", cwd=m)
    assert r.returncode == 1 and "Invalid argument" in r.stderr
    with lip.kv_open(k.path("a.kv")) as kv:                  # nothing lost on the way
        assert lip.kv_tokens(kv) == tokens
