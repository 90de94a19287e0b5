"""kvfsd's FUSE handlers without a mount: every handler turns every exception into an
errno (never one that escapes pyfuse3.main), writes are bounded before any work, and
policy xattrs reach predd before they are stored."""
import collections
import errno
import inspect
import os
import stat
import types

import pyfuse3
import pytest
import trio

from kvfsd.fs import PRIVATE_MASK, KvFs
from kvfsd.handles import Handle
from kvfsd.namespace import ROOT, Namespace
from kvfsd.policy import Policy, PolicyPorts
from kvfsd.predd_link import PreddError
from symphony_protocol import descriptor
CAP = "0123456789abcdef" * 2


class FakeCaches:
    """What KvFs needs of Caches; every predd-side call fails in a chosen way."""

    def __init__(self, failure: BaseException | None = None) -> None:
        self.ns = Namespace()
        self.predd = types.SimpleNamespace(up=True, info={"model": "m"}, stats={})
        self.lines: list[str] = []
        self.log = self.lines.append
        self.handles: dict = {}
        self.failure = failure
        self.commits = 0

    async def commit(self):
        self.commits += 1

    def link(self, node):
        return self.predd

    async def refresh(self, node, strict=False):
        if self.failure is not None:
            raise self.failure

    async def create(self, owner):
        if self.failure is not None:
            raise self.failure
        return {"cap": CAP, "tokens": 0, "pages": 0}

    def seen(self, node, reply):
        pass

    async def restore_backup(self, handle):
        pass

    async def apply(self, handle):
        if self.failure is not None:
            raise self.failure


def ctx(uid=1000, gid=1000, umask=0o022):
    return types.SimpleNamespace(uid=uid, gid=gid, umask=umask, pid=1)


def run(fn, *args):
    async def go():
        return await fn(*args)
    return trio.run(go)


def errno_of(fn, *args) -> int:
    with pytest.raises(pyfuse3.FUSEError) as e:
        run(fn, *args)
    return e.value.errno


def test_every_handler_is_behind_the_errno_boundary():
    ops = {name for name, member in inspect.getmembers(pyfuse3.Operations)
           if inspect.iscoroutinefunction(member)}
    mine = {name for name in vars(KvFs) if name in ops}
    assert {"lookup", "write", "setxattr", "flush", "release", "readdir"} <= mine
    unwrapped = [name for name in mine - {"forget"}
                 if not hasattr(getattr(KvFs, name), "__wrapped__")]
    assert unwrapped == []


@pytest.mark.parametrize("failure, code", [
    (MemoryError(), errno.EIO),
    (KeyError(CAP), errno.EIO),
    (RecursionError(), errno.EIO),
    (ValueError("x"), errno.EIO),
    (OSError(errno.ENOSPC, "disk full"), errno.ENOSPC),
    (PreddError("EDQUOT", "uid 65534 would hold more than 8 KV pages"), errno.EDQUOT),
    (PreddError("ETIMEDOUT", "no answer"), errno.EIO),
    (pyfuse3.FUSEError(errno.EACCES), errno.EACCES),
])
def test_any_exception_becomes_an_errno_and_a_log_line_without_its_message(failure, code):
    caches = FakeCaches(failure)
    fs = KvFs(caches)
    a = caches.ns.add(ROOT, b"a.kv", stat.S_IFREG | 0o600, 0, 0)
    assert errno_of(fs.getattr, a.ino, ctx()) == code
    assert errno_of(fs.create, ROOT, b"b.kv", 0o644, os.O_WRONLY, ctx()) == code
    if code == errno.EIO and not isinstance(failure, PreddError):
        assert caches.lines and all("getattr" in line or "create" in line
                                    for line in caches.lines)
        assert all(CAP not in line and "unexpected" in line for line in caches.lines)


def test_namespace_errors_keep_their_errno():
    fs = KvFs(FakeCaches())
    assert errno_of(fs.lookup, ROOT, b"missing", ctx()) == errno.ENOENT
    assert errno_of(fs.getattr, 999, ctx()) == errno.ENOENT
    assert errno_of(fs.mkdir, ROOT, b"x" * 256, 0o755, ctx()) == errno.ENAMETOOLONG
    assert errno_of(fs.read, 12345, 0, 10) == errno.EBADF
    assert errno_of(fs.setxattr, ROOT, b"user.kv.note", b"v", ctx()) == errno.EOPNOTSUPP
    assert errno_of(fs.mknod, ROOT, b"fifo", stat.S_IFIFO | 0o600, 0, ctx()) == errno.EPERM


def test_forget_never_raises():
    caches = FakeCaches()
    fs = KvFs(caches)

    async def broken(node):
        raise MemoryError()
    caches.maybe_free = broken
    a = caches.ns.add(ROOT, b"a.kv", stat.S_IFREG | 0o600, 0, 0)
    a.lookups = 1
    run(fs.forget, [(a.ino, 1), (12345, 1)])
    assert len(caches.lines) == 1 and "forget" in caches.lines[0]


def test_new_files_and_directories_are_private():
    caches = FakeCaches()
    fs = KvFs(caches)
    info, attr = run(fs.create, ROOT, b"a.kv", 0o666, os.O_WRONLY, ctx(umask=0))
    assert stat.S_IMODE(attr.st_mode) == 0o600 and attr.st_uid == 1000
    attr = run(fs.mkdir, ROOT, b"d", 0o777, ctx(umask=0))
    assert stat.S_IMODE(attr.st_mode) == 0o700
    attr = run(fs.mkdir, ROOT, b"e", 0o1777, ctx(umask=0o022))
    assert stat.S_IMODE(attr.st_mode) == 0o1700
    assert PRIVATE_MASK == 0o077
    assert fs.handles[info.fh].uid == 1000


def test_writes_past_the_descriptor_limit_are_refused_before_any_work():
    node = Namespace().add(ROOT, b"a.kv", stat.S_IFREG | 0o600, 0, 0)
    h = Handle(1, node, os.O_WRONLY)
    with pytest.raises(pyfuse3.FUSEError) as e:
        h.accept(1 << 62, b"k")                 # would need exabytes of padding
    assert e.value.errno == errno.EFBIG and h.rejected and h.written is None
    with pytest.raises(pyfuse3.FUSEError) as e:
        h.accept(0, b"kvfs 1\n")                # a poisoned open stays refused
    assert e.value.errno == errno.EINVAL

    h = Handle(2, node, os.O_WRONLY)
    h.accept(0, b"kvfs 1")
    h.accept(descriptor.MAX_LEN - 1, b"k")      # ends exactly at the limit: fine so far
    assert len(h.written) == descriptor.MAX_LEN
    with pytest.raises(pyfuse3.FUSEError) as e:
        h.accept(descriptor.MAX_LEN, b"k")      # one past it
    assert e.value.errno == errno.EFBIG
    with pytest.raises(pyfuse3.FUSEError) as e:  # but it does not start like a descriptor
        Handle(3, node, os.O_WRONLY).accept(0, b"x")
    assert e.value.errno == errno.EINVAL

    h = Handle(4, node, os.O_WRONLY | os.O_APPEND)
    text = descriptor.Descriptor(CAP).encode()
    h.accept(1 << 40, text[:10])                # O_APPEND: the offset is the end
    h.accept(0, text[10:])
    assert descriptor.parse(h.written) == descriptor.Descriptor(CAP)
    with pytest.raises(pyfuse3.FUSEError) as e:
        h.accept(0, b"x" * descriptor.MAX_LEN)
    assert e.value.errno == errno.EFBIG


def test_a_write_through_the_handler_past_the_limit_is_efbig():
    caches = FakeCaches()
    fs = KvFs(caches)
    info, _ = run(fs.create, ROOT, b"a.kv", 0o600, os.O_WRONLY, ctx())
    assert errno_of(fs.write, info.fh, 1 << 40, b"k") == errno.EFBIG
    assert errno_of(fs.write, info.fh, 0, b"kvfs 1\n") == errno.EINVAL


class PolicyCaches(FakeCaches):
    """FakeCaches with the real Policy: predd's kv_policy answers `answer` (an errno
    name to fail with, or None), and every call is recorded."""

    def __init__(self, answer: str | None = None) -> None:
        super().__init__()
        self.answer = answer
        self.calls: list[tuple[str, dict]] = []
        self.locks = collections.defaultdict(trio.Lock)
        self.policy = Policy(PolicyPorts(ns=self.ns, log=self.log, locks=self.locks,
                                         link=self.link, on_cache=self.on_cache))
        self.watched: list[int] = []
        self.expiry = types.SimpleNamespace(watch=lambda node: self.watched.append(node.ino))

    async def on_cache(self, node, op, **fields):
        self.calls.append((op, fields))
        if self.answer is not None:
            raise pyfuse3.FUSEError(getattr(errno, self.answer))
        return {"tokens": 0}, []


@pytest.mark.parametrize("answer, code, stored", [
    (None, None, b"1"),
    ("EDQUOT", errno.EDQUOT, None),              # refused: nothing stored
    ("ENOSYS", None, b"1"),                       # a predd without kv_policy: a hint
])
def test_pin_asks_predd_before_it_is_stored(answer, code, stored):
    caches = PolicyCaches(answer)
    fs = KvFs(caches)
    a = caches.ns.add(ROOT, b"a.kv", stat.S_IFREG | 0o600, 0, 0)
    a.cap = CAP
    if code is None:
        run(fs.setxattr, a.ino, b"user.kv.pin", b"1", ctx())
    else:
        assert errno_of(fs.setxattr, a.ino, b"user.kv.pin", b"1", ctx()) == code
    assert caches.calls == [("kv_policy", {"pin": True})]
    assert a.xattrs.get(b"user.kv.pin") == stored
    assert errno_of(fs.setxattr, a.ino, b"user.kv.pin", b"2", ctx()) == errno.EINVAL
    assert len(caches.calls) == 1                # a bad value never reaches predd


def test_unpin_evict_and_ttl():
    caches = PolicyCaches()
    fs = KvFs(caches)
    a = caches.ns.add(ROOT, b"a.kv", stat.S_IFREG | 0o600, 0, 0)
    a.cap = CAP
    d = caches.ns.add(ROOT, b"d", stat.S_IFDIR | 0o700, 0, 0)
    run(fs.setxattr, a.ino, b"user.kv.pin", b"1", ctx())
    run(fs.removexattr, a.ino, b"user.kv.pin", ctx())
    run(fs.setxattr, a.ino, b"user.kv.evict", b"1", ctx())
    assert caches.calls == [("kv_policy", {"pin": True}), ("kv_policy", {"pin": False}),
                            ("kv_policy", {"evict": True})]
    assert a.xattrs == {}                                       # evict is not stored
    assert errno_of(fs.getxattr, a.ino, b"user.kv.evict", ctx()) == errno.ENODATA
    assert errno_of(fs.setxattr, d.ino, b"user.kv.evict", b"1", ctx()) == errno.EOPNOTSUPP
    run(fs.setxattr, a.ino, b"user.kv.ttl", b"30", ctx())
    assert caches.watched == [a.ino] and a.xattrs == {b"user.kv.ttl": b"30"}
    caches.answer = "ENOSYS"
    assert errno_of(fs.setxattr, a.ino, b"user.kv.evict", b"1", ctx()) == errno.EOPNOTSUPP
    caches.answer = "EBUSY"
    assert errno_of(fs.setxattr, a.ino, b"user.kv.evict", b"1", ctx()) == errno.EBUSY
