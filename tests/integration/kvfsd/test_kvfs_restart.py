"""Restarts and failures: kvfsd restarted alone loses nothing; predd killed under a live
mount gives EIO within a second or so and the mount recovers when predd returns at the
same address; both daemons restarted bring back every fsync'd cache bit-exactly; kvfsd
stopped by a signal never leaves a dead mount; kvfsd killed with SIGKILL in a burst of
changes loses none that returned."""
import errno
import os
import signal
import stat
import threading
import time

import numpy as np
import pytest

from kvfsd.check import check_state
from tests.conftest import start_predd
from tests.integration.kvfs_fixtures import (eventually, fill, finish, is_mounted,
                                             pred_logits, sh, start_kvfsd, xattr_int)

PRIVATE_PREDD = ("--kv-pages", "128", "--max-step-tokens", "256", "--lease", "3")
PROMPT = "Persistence test: the quick brown fox jumps over the lazy dog, twice over."


@pytest.fixture
def private(tmp_path):
    """Own predd instances (restartable at one address) for tests that kill or stop
    predd, and the kvfsd over them; everything is stopped at the end."""
    import liblip

    class Private:
        rundir = str(tmp_path / "run")
        state = str(tmp_path / "state")
        predd = None
        kvfs = None

        def start_predd(self):
            self.predd = start_predd(self.rundir, *PRIVATE_PREDD)
            liblip.connect(self.predd.addr, dead_after_s=60)
            return self.predd

    p = Private()
    try:
        yield p
    finally:
        alive = p.predd is not None and p.predd.proc.poll() is None
        if p.kvfs is not None:
            finish(p.kvfs, clear=alive)
        if alive:
            liblip.client().close()     # while predd can still answer its bye
        if p.predd is not None:
            p.predd.stop()
        liblip.client().close()


def test_kvfsd_restart_alone_loses_nothing(kvfs, lip):
    m = kvfs.mount
    setup = ("mkdir -p d/e && touch d/a.kv && ln d/a.kv b.kv && ln -s d/a.kv sym && "
             "chmod 640 d/a.kv && chown nobody:nogroup d/a.kv && "
             "setfattr -n user.kv.pin -v 1 d/a.kv && setfattr -n user.kv.ttl -v 60 d/a.kv && "
             "setfattr -n user.note -v hi d/e && chmod 751 d/e")
    assert sh(setup, cwd=m).returncode == 0
    tokens = lip.tokenize(PROMPT)
    fill(lip, f"{m}/d/a.kv", tokens)
    assert sh("cp b.kv d/e/c.kv && touch -d 2001-02-03 d/e/c.kv", cwd=m).returncode == 0
    names = ["d", "d/e", "d/a.kv", "b.kv", "d/e/c.kv"]
    before = {n: os.stat(f"{m}/{n}") for n in names}
    xattrs = {n: {x: os.getxattr(f"{m}/{n}", x) for x in os.listxattr(f"{m}/{n}")}
              for n in names}
    objects = eventually(lambda: lip.stats()["objects"])
    stats0 = lip.stats()

    kvfs.restart()

    for n in names:
        st = os.stat(f"{m}/{n}")
        old = before[n]
        assert (st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_nlink, st.st_size,
                st.st_blocks, st.st_mtime_ns) == \
            (old.st_ino, old.st_mode, old.st_uid, old.st_gid, old.st_nlink, old.st_size,
             old.st_blocks, old.st_mtime_ns), n
        assert {x: os.getxattr(f"{m}/{n}", x) for x in os.listxattr(f"{m}/{n}")} == xattrs[n]
    assert os.readlink(f"{m}/sym") == "d/a.kv"
    for n in ("b.kv", "d/e/c.kv"):
        with lip.kv_open(f"{m}/{n}") as kv:
            assert lip.kv_tokens(kv) == tokens
    stats1 = lip.stats()
    assert stats1["objects"] == objects == stats0["objects"]
    assert stats1["pages_free"] == stats0["pages_free"]
    assert "lost" not in kvfs.log_text()


@pytest.mark.slow
def test_predd_killed_then_both_daemons_restarted(private):
    """One story, three predd processes at one address (a predd start is the slow part):
    1. predd is killed under a live mount: EIO at once, and nothing hangs;
    2. predd comes back: the mount recovers by itself, the fsync'd caches are restored,
       the others are gone, each with a log line;
    3. both daemons are stopped and started again: the fsync'd caches are back with the
       same tokens and bit-identical logits, modes and xattrs."""
    import liblip as lip
    private.start_predd()
    private.kvfs = k = start_kvfsd(private.predd.addr, private.state)
    m = k.mount
    prompt = lip.tokenize(PROMPT)
    sh("touch a.kv c.kv", cwd=m)
    fill(lip, f"{m}/a.kv", prompt[:-1])
    assert sh("cp a.kv b.kv && chmod 600 a.kv && setfattr -n user.kv.pin -v 1 a.kv",
              cwd=m).returncode == 0
    fill(lip, f"{m}/b.kv", lip.tokenize(" And once more."))
    fill(lip, f"{m}/c.kv", prompt[:5])
    assert sh("sync a.kv b.kv", cwd=m).returncode == 0
    synced = ("a.kv", "b.kv")
    want = {n: lip.kv_tokens(lip.kv_open(f"{m}/{n}")) for n in synced}
    ref = {n: pred_logits(lip, f"{m}/{n}", prompt[-1]) for n in synced}
    blocks = os.stat(f"{m}/a.kv").st_blocks

    def check_restored() -> None:
        for n in synced:
            with lip.kv_open(f"{m}/{n}") as kv:
                assert lip.kv_tokens(kv) == want[n]
            got = pred_logits(lip, f"{m}/{n}", prompt[-1])
            assert np.array_equal(got, ref[n]), np.abs(got - ref[n]).max()
        assert stat.S_IMODE(os.stat(f"{m}/a.kv").st_mode) == 0o600
        assert os.getxattr(f"{m}/a.kv", "user.kv.pin") == b"1"

    # 1. predd killed.
    private.predd.proc.kill()
    private.predd.proc.wait()
    t0 = time.monotonic()
    r = sh("cat a.kv", cwd=m)
    first_eio = time.monotonic() - t0
    assert r.returncode == 1 and "Input/output error" in r.stderr
    t0 = time.monotonic()
    for cmd in ("touch new.kv", "cp a.kv x.kv", "getfattr -n user.kv.tokens a.kv",
                ": > a.kv"):
        r = sh(cmd, cwd=m)
        assert r.returncode == 1 and "Input/output error" in r.stderr, (cmd, r.stderr)
    later_eio = (time.monotonic() - t0) / 4
    print(f"\nEIO after predd was killed: first op {first_eio:.2f} s, "
          f"next ops {later_eio * 1e3:.0f} ms each")
    assert first_eio < 3.0
    with pytest.raises(OSError) as e:
        os.open(f"{m}/a.kv", os.O_RDONLY)
    assert e.value.errno == errno.EIO
    # The namespace still answers: names, modes, last-seen sizes.
    r = sh("ls -l", cwd=m)
    assert r.returncode == 0 and "a.kv" in r.stdout and "c.kv" in r.stdout
    assert os.stat(f"{m}/a.kv").st_blocks == blocks

    # 2. predd back at the same address (same rundir), kvfsd still up.
    log_from = len(k.log_text())
    private.start_predd()
    t0 = time.monotonic()
    assert eventually(lambda: sh("touch new.kv", cwd=m).returncode == 0, timeout=30)
    print(f"mount usable {time.monotonic() - t0:.2f} s after predd was back")
    assert eventually(lambda: "c.kv" not in os.listdir(m), timeout=10)
    assert sorted(os.listdir(m)) == ["a.kv", "b.kv", "new.kv"]
    log = k.log_text()[log_from:]
    assert "/c.kv: cache lost (predd restarted and it was never fsync'd)" in log
    assert "/a.kv: restored from its fsync'd snapshot" in log
    check_restored()
    assert sh("cp a.kv x.kv && rm new.kv x.kv", cwd=m).returncode == 0

    # 3. Both daemons restarted, kvfsd first: it mounts without predd (EIO meanwhile)
    #    and restores the caches once predd answers.
    assert k.stop() == 0 and private.predd.stop() == 0
    log_from = len(k.log_text())
    t0 = time.monotonic()
    k.start()
    assert time.monotonic() - t0 < 10
    r = sh("touch new.kv", cwd=m)
    assert r.returncode == 1 and "Input/output error" in r.stderr
    private.start_predd()
    assert eventually(lambda: "/b.kv: restored" in k.log_text()[log_from:], timeout=30)
    log = k.log_text()[log_from:]
    assert "/a.kv: restored from its fsync'd snapshot" in log
    assert sorted(os.listdir(m)) == ["a.kv", "b.kv"]
    check_restored()
    pages = xattr_int(f"{m}/a.kv", "pages") + xattr_int(f"{m}/b.kv", "pages")
    assert eventually(lambda: lip.stats()["pages_used"] == pages)
    assert lip.fsck()["clean"]


def test_signals_unmount_cleanly_and_a_killed_kvfsd_is_cleaned_up(predd, lip, tmp_path):
    k = start_kvfsd(predd.addr, str(tmp_path / "state"))
    try:
        fd = os.open(k.path("a.kv"), os.O_CREAT | os.O_RDWR, 0o644)   # busy mount
        k.proc.send_signal(signal.SIGTERM)
        assert k.proc.wait(timeout=20) == 0
        assert not is_mounted(k.mount)
        try:
            os.close(fd)
        except OSError:
            pass
        assert os.listdir(k.mount) == []                  # the bare directory again
        # SIGKILL leaves a dead mount; the next kvfsd detaches it and serves the state.
        k.start()
        k.proc.kill()
        k.proc.wait()
        with pytest.raises(OSError) as e:
            os.stat(k.mount)
        assert e.value.errno == errno.ENOTCONN
        k.start(clear_stale=False)
        assert "detaching the dead mount" in k.log_text()
        assert os.listdir(k.mount) == ["a.kv"]
        k.proc.send_signal(signal.SIGINT)
        assert k.proc.wait(timeout=20) == 0
        assert not is_mounted(k.mount)
        k.start()
    finally:
        finish(k)


# ---------------------------------------------------------------- crash safety

BURST = 100          # operations per worker per round


def _tag(path: str) -> bytes | None:
    """A file's user.tag; b"" for a file without one, None for no such file."""
    try:
        return os.getxattr(path, "user.tag")
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ENODATA:
            raise
        return b""


def _burst(k, p: str, kill_after: int) -> dict[str, int]:
    """Four workers change the namespace as fast as they can — cross-directory renames,
    creates, unlinks, renames over an existing name — and kvfsd is killed with SIGKILL
    once `kill_after` operations succeeded. How many each saw succeed, in order."""
    m = k.mount
    ops = {
        "move": lambda i: os.rename(f"{m}/{p}m{i}.kv", f"{m}/sub/{p}m{i}.kv"),
        "create": lambda i: os.open(f"{m}/{p}c{i}.kv", os.O_WRONLY | os.O_CREAT
                                    | os.O_EXCL, 0o600),
        "unlink": lambda i: os.unlink(f"{m}/{p}u{i}.kv"),
        "replace": lambda i: os.rename(f"{m}/{p}x{i}.kv", f"{m}/{p}y{i}.kv"),
    }
    done = dict.fromkeys(ops, 0)
    fds: list[int] = []

    def worker(name: str) -> None:
        for i in range(BURST):
            try:
                out = ops[name](i)
            except OSError:
                return                     # the mount died under this call
            if name == "create":
                fds.append(out)
            done[name] += 1

    threads = [threading.Thread(target=worker, args=(name,)) for name in ops]
    for t in threads:
        t.start()
    while sum(done.values()) < kill_after and any(t.is_alive() for t in threads):
        time.sleep(0.0005)
    k.proc.kill()
    k.proc.wait()
    for t in threads:
        t.join(timeout=30)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    return dict(done)


def test_kill_9_during_a_burst_loses_no_committed_name(predd, lip, tmp_path):
    """Every rename, create and unlink that returned before a SIGKILL of kvfsd is there
    after a fresh kvfsd mounts the same state; the one each worker had in flight either
    happened or not, whole; no file has two names it should not have; the state the
    crash left is consistent (kvfsd.check) and every cache is still predd's."""
    k = start_kvfsd(predd.addr, str(tmp_path / "state"))
    m = k.mount
    try:
        os.mkdir(k.path("sub"))
        for rnd, kill_after in enumerate((20, 120, 250)):
            p = f"r{rnd}-"
            for i in range(BURST):
                for kind in "muxy":
                    path = f"{m}/{p}{kind}{i}.kv"
                    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                    os.setxattr(path, "user.tag", f"{p}{kind}{i}".encode())
            done = _burst(k, p, kill_after)
            print(f"\nround {rnd}: killed after {done}")
            assert any(n < BURST for n in done.values()), done   # killed mid-burst
            assert check_state(k.state) == []        # as the crash left it
            k.start()
            for i in range(BURST):
                tag = f"{p}m{i}".encode()
                at = (_tag(f"{m}/{p}m{i}.kv"), _tag(f"{m}/sub/{p}m{i}.kv"))
                want = {(None, tag)} if i < done["move"] else \
                    {(tag, None)} if i > done["move"] else {(None, tag), (tag, None)}
                assert at in want, ("move", i, done, at)
                there = os.path.exists(f"{m}/{p}c{i}.kv")
                assert there if i < done["create"] else \
                    not there if i > done["create"] else True, ("create", i, done)
                there = os.path.exists(f"{m}/{p}u{i}.kv")
                assert not there if i < done["unlink"] else \
                    there if i > done["unlink"] else True, ("unlink", i, done)
                at = (_tag(f"{m}/{p}x{i}.kv"), _tag(f"{m}/{p}y{i}.kv"))
                x, y = f"{p}x{i}".encode(), f"{p}y{i}".encode()
                want = {(None, x)} if i < done["replace"] else \
                    {(x, y)} if i > done["replace"] else {(None, x), (x, y)}
                assert at in want, ("replace", i, done, at)
            paths = [f"{m}/{n}" for n in os.listdir(m) if n != "sub"] + \
                [f"{m}/sub/{n}" for n in os.listdir(f"{m}/sub")]
            tags = [t for t in map(_tag, paths) if t]
            assert len(tags) == len(set(tags))                       # one name per file
            assert len({os.stat(path).st_ino for path in paths}) == len(paths)
            assert {os.getxattr(path, "user.kv.tokens") for path in paths} == {b"0"}
            assert "cache lost" not in k.log_text()
        report = lip.fsck()
        assert report["clean"], report["problems"]
    finally:
        finish(k)
