"""kvfsd/expiry.py without a mount or predd: when a file with `user.kv.ttl` is removed
(last close and predd's last use both older than the ttl, no open), and that only the
files due are looked at."""
import time
import types

import trio

from kvfsd.expiry import Expiry, ExpiryPorts
from kvfsd.namespace import ROOT, Namespace

FILE = 0o100600
DIR = 0o040700


class FakeCaches:
    """What Expiry is given of the caches (`ExpiryPorts`): the namespace, a predd
    answering kv_stat with a chosen `idle_s` (None: a predd that does not report it), and
    records of what it did."""

    def __init__(self, idle_s: float | None = 100.0, up: bool = True) -> None:
        self.ns = Namespace()
        self.lines: list[str] = []
        self.log = self.lines.append
        self.freed: list[int] = []
        self.commits = 0
        self.stats = 0
        caches = self

        async def call(op, cap):
            assert op == "kv_stat"
            caches.stats += 1
            return {"tokens": 0} if idle_s is None else {"tokens": 0, "idle_s": idle_s}
        self.predd = types.SimpleNamespace(up=up, call=call)

    async def commit(self):
        self.commits += 1

    async def maybe_free(self, node):
        self.freed.append(node.ino)

    def link(self, node):
        return self.predd


def ttl_file(caches, name: bytes, ttl: bytes, closed_ago: float, parent: int = ROOT):
    node = caches.ns.add(parent, name, FILE, 0, 0)
    node.cap = "c" * 32
    node.xattrs[b"user.kv.ttl"] = ttl
    node.closed_at = time.monotonic() - closed_ago
    return node


def expiry_for(caches, started_ago: float = 60.0) -> Expiry:
    e = Expiry(ExpiryPorts(ns=caches.ns, log=caches.log, link=caches.link,
                           commit=caches.commit, maybe_free=caches.maybe_free))
    e.started = time.monotonic() - started_ago
    e.watch_all()
    return e


def check(e: Expiry) -> None:
    trio.run(e.check)


def test_a_file_quiet_for_its_ttl_loses_every_name_and_its_cache():
    caches = FakeCaches(idle_s=30.0)
    d = caches.ns.add(ROOT, b"d", DIR, 0, 0)
    a = ttl_file(caches, b"a.kv", b"5", closed_ago=10)
    caches.ns.link(a.ino, d.ino, b"a2.kv")
    keep = caches.ns.add(ROOT, b"keep.kv", FILE, 0, 0)          # no ttl
    e = expiry_for(caches)
    assert len(e) == 1                                          # only files with a ttl
    check(e)
    assert caches.ns.names_of(a.ino) == [] and a.nlink == 0
    assert caches.freed == [a.ino] and caches.commits == 1
    assert caches.lines == ["/a.kv: removed (user.kv.ttl 5 s ran out)"]
    assert caches.ns.lookup(ROOT, b"keep.kv") is keep
    assert len(e) == 0


def test_an_open_file_is_never_removed_and_a_recent_use_or_close_defers_it():
    caches = FakeCaches(idle_s=1.0)                 # predd: used a second ago
    used = ttl_file(caches, b"used.kv", b"5", closed_ago=10)
    held = ttl_file(caches, b"held.kv", b"5", closed_ago=10)
    held.opens = 1
    closed = ttl_file(caches, b"closed.kv", b"5", closed_ago=2)
    e = expiry_for(caches)
    check(e)
    assert caches.freed == [] and all(n.nlink == 1 for n in (used, held, closed))
    assert caches.stats == 1                        # closed.kv needs no predd to wait
    due = dict(e._due)
    now = time.monotonic()
    assert 3.5 < due[used.ino] - now <= 4.0         # its last use + 5 s
    assert 2.5 < due[closed.ino] - now <= 3.0       # its last close + 5 s
    assert 0.5 < due[held.ino] - now <= 1.0         # looked at again each period


def test_without_idle_s_the_last_close_decides_and_kvfsd_start_counts_as_one():
    caches = FakeCaches(idle_s=None)
    old = ttl_file(caches, b"old.kv", b"5", closed_ago=6)
    never = ttl_file(caches, b"never.kv", b"10", closed_ago=0)
    never.closed_at = 0.0                           # not opened since kvfsd started
    e = expiry_for(caches, started_ago=8)
    check(e)
    assert caches.freed == [old.ino] and never.nlink == 1
    assert 1.5 < e._due[never.ino] - time.monotonic() <= 2.0     # the start + 10 s


def test_nothing_is_removed_while_predd_is_down_or_after_the_ttl_went():
    caches = FakeCaches(up=False)
    a = ttl_file(caches, b"a.kv", b"5", closed_ago=10)
    b = ttl_file(caches, b"b.kv", b"5", closed_ago=10)
    e = expiry_for(caches)
    del b.xattrs[b"user.kv.ttl"]
    check(e)
    assert caches.freed == [] and a.nlink == 1 and b.nlink == 1
    assert set(e._due) == {a.ino}                   # b is no longer watched
    caches.predd.up = True
    trio.run(e.check, time.monotonic() + 2)
    assert caches.freed == [a.ino]


def test_a_check_looks_only_at_the_files_due():
    caches = FakeCaches()
    for i in range(10_000):
        ttl_file(caches, b"f%d.kv" % i, b"3600", closed_ago=0)
    e = expiry_for(caches)
    check(e)                                        # each scheduled for its close + 1 h
    assert caches.stats == 0 and len(e) == 10_000
    t = time.perf_counter()
    for _ in range(100):
        check(e)
    assert e._heap[0][0] > time.monotonic()         # nothing due: nothing popped
    assert caches.stats == 0 and caches.freed == []
    print(f"\n100 checks of 10,000 files with a ttl: {time.perf_counter() - t:.3f} s")
