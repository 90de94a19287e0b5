"""kvfsd over several replicas without predd or a mount: the real Caches, Migration and
state directory over fake predd links (each a dict of objects), so every move, re-home,
free and count is checked exactly."""
import errno
import json
import os
import stat
from collections import Counter

import pyfuse3
import pytest
import trio
import trio.testing

from kvfsd import xattrs
from kvfsd.caches import Caches
from kvfsd.handles import Handle
from kvfsd.namespace import ROOT, Namespace
from kvfsd.predd_link import PreddError
from kvfsd.replicas import Replicas
from kvfsd.state import StateDir
from tests.unit.kvfsd.test_kvfs_handlers import errno_of, run
from symphony_protocol import descriptor
A, B, C = "ipc:///run/a.sock", "ipc:///run/b.sock", "ipc:///run/c.sock"


class FakePredd:
    """One replica's objects: capability -> tokens; requests as predd answers them (EIO
    while its link is down, as PreddLink does)."""

    def __init__(self, name: str, link) -> None:
        self.name = name
        self.link = link
        self.objects: dict[str, list[int]] = {}
        self.calls: list[str] = []
        self._n = 0

    def _new(self, tokens: list[int]) -> dict:
        self._n += 1
        cap = f"{self.name}{self._n:031x}"[:32]
        self.objects[cap] = list(tokens)
        return {"cap": cap, "rights": "rw", "tokens": len(tokens), "pages": 1}

    async def request(self, op, *, timeout=None, frames=(), probe=False, **f):
        if not self.link.up:
            raise PreddError("EIO", "down")
        self.calls.append(op)
        if op == "kv_create":
            return self._new([]), []
        if op == "kv_import":
            return self._new(json.loads(bytes(frames[0]))), []
        cap = f.get("cap")
        if cap not in self.objects:
            raise PreddError("EBADF", "unknown capability")
        if op == "kv_export":
            return {"tokens": len(self.objects[cap])}, [json.dumps(self.objects[cap]).encode()]
        if op in ("kv_fork", "kv_grant"):
            return self._new(self.objects[cap]), []
        if op == "kv_free":
            del self.objects[cap]
            return {}, []
        if op in ("kv_stat", "kv_policy"):
            return {"tokens": len(self.objects[cap]), "pages": 1}, []
        raise AssertionError(op)


def setup(tmp_path, addrs=(A, B), doc=None):
    replicas = Replicas(list(addrs), log=lambda line: None)
    fakes = {}
    for link in replicas:
        fake = fakes[link.addr] = FakePredd(link.addr[-6], link)
        link.request = fake.request
        link.up = True
        link.client = object()
        link.info = {"model": "m"}
    ns = Namespace.from_dict(doc) if doc else Namespace()
    lines: list[str] = []
    caches = Caches(ns, StateDir(str(tmp_path / "state")), replicas, lines.append)
    return caches, fakes, lines


def add_file(caches, fakes, name: bytes, addr: str, tokens: list[int]):
    node = caches.ns.add(ROOT, name, stat.S_IFREG | 0o600, 1000, 1000)
    node.cap = fakes[addr]._new(tokens)["cap"]
    node.replica, node.tokens = addr, len(tokens)
    return node


def test_new_files_go_to_the_live_replicas_in_turn_skipping_a_full_one():
    r = Replicas([A, B, C], log=print)
    assert [r.next_home() for _ in range(2)] == [r.first, r.first]    # none live yet
    for link in r:
        link.up = True                      # no stats yet: each counts as roomy
    assert [r.next_home().addr for _ in range(7)] == [A, B, C, A, B, C, A]
    r.links[1].up = False                   # B down: skipped, the turn goes on
    assert [r.next_home().addr for _ in range(4)] == [C, A, C, A]
    r.links[1].up = True
    r.links[2].stats = {"pages_total": 64, "pages_free": 0}             # C full
    assert [r.next_home().addr for _ in range(4)] == [B, A, B, A]
    for link in r:
        link.stats = {"pages_total": 64, "pages_free": 0}                  # all full
    assert [r.next_home().addr for _ in range(3)] == [B, C, A]


def test_replicas_in_order_unknown_addresses_and_the_report():
    r = Replicas([A, B, A], log=print)
    assert [link.addr for link in r] == [A, B] and r.first.addr == A
    assert r.get("") is r.first and r.get(B) is r.links[1]
    assert r.known(B) and not r.known(C)
    gone = r.get(C)
    assert gone is r.get(C) and gone not in r.links and not gone.up
    with pytest.raises(PreddError) as e:
        trio.run(lambda: gone.call("kv_stat", cap="0" * 32))
    assert e.value.errno == errno.EIO
    assert r.first_live() is None and r.most_free() is None
    for link, free in zip(r, (10, 30)):
        link.up, link.stats = True, {"pages_total": 64, "pages_free": free,
                                     "pending_calls": free // 10}
    assert r.first_live() is r.links[0] and r.most_free() is r.links[1]
    r.links[0].up = False
    assert r.report(Counter({A: 2, B: 1, C: 5})) == \
        f"{A} down files=2 pages=54/64 calls=1\n{B} up files=1 pages=34/64 calls=3\n"
    r.count_migration(100)
    r.count_migration(23)
    assert (r.migrations, r.migrated_bytes, r.restored) == (2, 123, 0)


def test_rehome_and_replica_xattrs_are_checked():
    xattrs.check(xattrs.REHOME, b"")
    xattrs.check(xattrs.REHOME, b"auto")
    xattrs.check(xattrs.REHOME, ("ipc:///" + "d/" * 60 + "p.sock").encode())  # > 64 bytes
    for bad in (b"elsewhere", b"ipc://", b"http://x:1"):
        with pytest.raises(OSError) as e:
            xattrs.check(xattrs.REHOME, bad)
        assert e.value.errno == errno.EINVAL
    for name in (xattrs.REPLICA, xattrs.REPLICAS, xattrs.MIGRATIONS):
        with pytest.raises(OSError) as e:
            xattrs.check(name, A.encode())
        assert e.value.errno == errno.EPERM
    with pytest.raises(OSError) as e:
        xattrs.check_room({}, xattrs.REHOME, is_file=False)
    assert e.value.errno == errno.EOPNOTSUPP


def test_rehome_moves_the_cache_and_counts_it(tmp_path):
    caches, fakes, lines = setup(tmp_path)
    node = add_file(caches, fakes, b"a.kv", A, [1, 2, 3])
    old = node.cap
    run(caches.migration.rehome, node, B.encode(), 1000)
    assert node.replica == B and fakes[B].objects[node.cap] == [1, 2, 3]
    assert old not in fakes[A].objects and fakes[A].objects == {}
    size = len(json.dumps([1, 2, 3]).encode())
    assert (caches.replicas.migrations, caches.replicas.migrated_bytes) == (1, size)
    run(caches.migration.rehome, node, B.encode(), 1000)          # already there: nothing
    assert caches.replicas.migrations == 1 and fakes[B].calls.count("kv_import") == 1
    assert lines == [f"/a.kv: moved from {A} to {B} ({size} bytes)"]
    assert caches.state.load() is not None
    row = next(n for n in caches.state.load()["nodes"] if n["ino"] == node.ino)
    assert (row["cap"], row["replica"]) == (node.cap, B)


def test_rehome_errors_change_nothing(tmp_path):
    caches, fakes, _ = setup(tmp_path)
    node = add_file(caches, fakes, b"a.kv", A, [1, 2])
    cap = node.cap
    node.opens = 1
    assert errno_of(caches.migration.rehome, node, B.encode(), 1000) == errno.EBUSY
    node.opens = 0
    assert errno_of(caches.migration.rehome, node, C.encode(), 1000) == errno.EINVAL
    caches.replicas.get(B).up = False
    assert errno_of(caches.migration.rehome, node, B.encode(), 1000) == errno.EIO
    caches.replicas.get(A).up = False                         # no snapshot: stays
    caches.replicas.get(B).up = True
    assert errno_of(caches.migration.rehome, node, B.encode(), 1000) == errno.EIO
    assert (node.cap, node.replica, caches.replicas.migrations) == (cap, A, 0)
    assert fakes[B].objects == {}


def test_rehome_off_a_dead_home_restores_the_snapshot(tmp_path):
    caches, fakes, _ = setup(tmp_path)
    node = add_file(caches, fakes, b"a.kv", A, [5, 6, 7, 8])
    node.snapshot = caches.state.write_snapshot(node.ino, json.dumps([5, 6, 7, 8]).encode())
    old = node.cap
    caches.replicas.get(A).up = False
    caches.replicas.get(B).stats = {"pages_free": 9}
    run(caches.migration.rehome, node, b"auto", 1000)               # the live one: B
    assert node.replica == B and fakes[B].objects[node.cap] == [5, 6, 7, 8]
    assert (caches.replicas.migrations, caches.replicas.restored) == (0, 1)
    assert caches.pending_free == [(A, old)]                  # freed when A answers
    assert caches._meta()["pending_free"] == [[A, old]]


def write(caches, node, desc: descriptor.Descriptor, uid=1000) -> Handle:
    handle = Handle(1, node, os.O_WRONLY, uid=uid)
    node.opens += 1
    handle.accept(0, desc.encode())
    run(caches.apply, handle)
    node.opens -= 1
    return handle


def test_a_descriptor_from_another_replica_rehomes_an_empty_file_or_migrates(tmp_path):
    caches, fakes, _ = setup(tmp_path)
    src = fakes[B]._new([4, 4, 4])["cap"]
    empty = add_file(caches, fakes, b"e.kv", A, [])
    old = empty.cap
    write(caches, empty, descriptor.Descriptor(src, "r", replica=B))
    assert empty.replica == B and fakes[B].objects[empty.cap] == [4, 4, 4]
    assert old not in fakes[A].objects and caches.replicas.migrations == 0

    full = add_file(caches, fakes, b"f.kv", A, [1])
    old = full.cap
    write(caches, full, descriptor.Descriptor(src, "r", replica=B))
    assert full.replica == A and fakes[A].objects[full.cap] == [4, 4, 4]
    assert old not in fakes[A].objects
    assert set(fakes[B].objects) == {src, empty.cap}          # the fork on B was freed
    assert (caches.replicas.migrations, caches.replicas.migrated_bytes) == \
        (1, len(json.dumps([4, 4, 4]).encode()))

    with pytest.raises(pyfuse3.FUSEError) as e:
        write(caches, full, descriptor.Descriptor(src, "r", replica=C))
    assert e.value.errno == errno.EINVAL and fakes[A].objects[full.cap] == [4, 4, 4]


def test_grants_name_the_home_and_a_state_from_before_is_replica_0s(tmp_path):
    old = Namespace()
    f = old.add(ROOT, b"a.kv", stat.S_IFREG | 0o600, 0, 0)
    f.cap = "ab" * 16
    doc = old.to_dict()
    assert "replica" not in next(n for n in doc["nodes"] if n["ino"] == f.ino)
    replicas = Replicas([B, A], log=print)
    caches = Caches(Namespace.from_dict(doc), StateDir(str(tmp_path / "s")), replicas,
                    print, ["cd" * 16, [A, "ef" * 16], [C, "01" * 16]])
    assert caches.ns.nodes[f.ino].replica == B
    assert caches.pending_free == [(B, "cd" * 16), (A, "ef" * 16)]

    caches, fakes, _ = setup(tmp_path / "t")
    node = add_file(caches, fakes, b"b.kv", B, [1, 2])
    handle = Handle(2, node, os.O_RDONLY)
    run(caches.grant, handle)
    desc = descriptor.parse(handle.data)
    assert (desc.replica, desc.tokens, handle.replica) == (B, 2, B)
    assert desc.cap in fakes[B].objects
    run(caches.revoke, handle)
    assert desc.cap not in fakes[B].objects


def test_a_replica_is_named_by_its_address_or_the_same_socket_spelled_otherwise():
    two = Replicas([A, B, "ipc:///run/a.sock"], print)           # one link per address
    assert [link.addr for link in two] == [A, B]
    assert two.named("ipc:///run//x/../a.sock") is two.first
    assert two.known("ipc:///run/./b.sock") and not two.known(C)
    assert two.named(C) is None                                   # several: EINVAL
    one = Replicas([A], print)
    assert one.named(C) is one.first        # one predd: whatever a LIP calls it
    assert not one.known(C)                 # ... but a file homed on C is not A's


def test_one_uid_moves_one_file_at_a_time_and_never_holds_up_another(tmp_path):
    caches, fakes, _ = setup(tmp_path)
    files = [add_file(caches, fakes, name, A, [1, 2, 3]) for name in (b"x", b"y", b"z")]
    release = trio.Event()
    started: list[str] = []
    plain = fakes[A].request

    async def slow_export(op, **f):
        if op == "kv_export":
            started.append(f["cap"])
            await release.wait()
        return await plain(op, **f)

    caches.replicas.get(A).request = slow_export
    done: list[int] = []

    async def move(node, uid):
        await caches.migration.rehome(node, B.encode(), uid)
        done.append(node.ino)

    async def go():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(move, files[0], 1000)
            nursery.start_soon(move, files[1], 1000)     # queues behind uid 1000's first
            nursery.start_soon(move, files[2], 2000)     # another uid: goes at once
            await trio.testing.wait_all_tasks_blocked()
            # one of uid 1000's two moves, and uid 2000's (trio starts tasks in any order)
            assert len(started) == 2 and files[2].cap in started
            assert len({files[0].cap, files[1].cap} & set(started)) == 1
            release.set()
    trio.run(go)
    assert sorted(done) == sorted(n.ino for n in files)
    assert [n.replica for n in files] == [B, B, B]
    assert caches.replicas.migrations == 3
