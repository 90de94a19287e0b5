"""KV objects over the page pool: reserve/commit, fork + copy-on-write, truncate,
extract/merge (whole aligned pages shared, the rest copied), export/import, `check`.

`FakePages` stands in for the runner's cache: it holds a K/V vector per flat slot, and
every entry's vector spells out (token, position, layer, K-or-V), so a test can see
exactly which entry's data sits in which slot after copies, CoW, extract and merge.
"""
from __future__ import annotations

import itertools
import random
import struct
import zlib

import msgpack
import numpy as np
import pytest

from symphony_protocol import ProtocolError
from predd.memory.kvstore import EXPORT_MAGIC, KVStore
from predd.server.limits import MAX_POSITION
from predd.memory.pool import Pool

LAYERS, HEADS, DIM = 2, 1, 4
VOCAB, MAX_LENGTH = 1 << 16, 1 << 12   # what import_ accepts here


class FakePages:
    """PageData over a numpy array [layers, 2, slots, heads, dim]; records copies."""

    def __init__(self, num_pages: int, page_size: int, model: str = "fake") -> None:
        self.kv = np.full((LAYERS, 2, num_pages * page_size, HEADS, DIM), -1.0, np.float32)
        self.copies: list[tuple[list[int], list[int]]] = []
        self.model = model

    def copy_slots(self, src, dst):
        src, dst = np.asarray(src, np.int64), np.asarray(dst, np.int64)
        assert len(src) == len(dst)
        self.copies.append((src.tolist(), dst.tolist()))
        self.kv[:, :, dst] = self.kv[:, :, src]

    def read_slots(self, slots):
        return self.kv[:, :, np.asarray(slots, np.int64)].copy()

    def write_slots(self, slots, data):
        slots = np.asarray(slots, np.int64)
        self.kv[:, :, slots] = np.asarray(data).reshape(LAYERS, 2, len(slots), HEADS, DIM)

    def describe(self):
        return {"model": self.model, "dtype": "float32", "numpy_dtype": "float32",
                "layers": LAYERS, "kv_heads": HEADS, "head_dim": DIM}


def payload(tokens, positions) -> np.ndarray:
    """The K/V [layers, 2, n, heads, dim] that entry (token, position) carries."""
    tokens = np.asarray(tokens, np.float32)
    positions = np.asarray(positions, np.float32)
    n = len(tokens)
    out = np.zeros((LAYERS, 2, n, HEADS, DIM), np.float32)
    out[..., 0] = tokens[None, None, :, None]
    out[..., 1] = positions[None, None, :, None]
    out[..., 2] = np.arange(LAYERS, dtype=np.float32)[:, None, None, None]
    out[..., 3] = np.arange(2, dtype=np.float32)[None, :, None, None]
    return out


class World:
    """A store plus a model of what every object must hold; `verify` compares them."""

    def __init__(self, num_pages: int = 16, page_size: int = 4) -> None:
        self.pool = Pool(num_pages, page_size)
        self.pages = FakePages(num_pages, page_size)
        self.store = KVStore(self.pool, self.pages)
        self.want: dict[int, tuple[list[int], list[int]]] = {}
        self._tokens = itertools.count(100)

    # operations that keep the model in step
    def create(self) -> int:
        oid = self.store.create().oid
        self.want[oid] = ([], [])
        return oid

    def append(self, oid: int, n: int, positions=None) -> list[int]:
        tokens = [next(self._tokens) for _ in range(n)]
        if positions is None:
            first = self.store.last_position(self.store.get(oid)) + 1
            positions = list(range(first, first + n))
        slots = self.store.reserve(oid, n)
        self.pages.write_slots(slots, payload(tokens, positions))
        self.store.commit(oid, np.asarray(tokens), np.asarray(positions))
        self.want[oid][0].extend(tokens)
        self.want[oid][1].extend(positions)
        return slots.tolist()

    def import_(self, blob: bytes):
        return self.store.import_(blob, VOCAB, MAX_LENGTH)

    def filled(self, n: int, positions=None) -> int:
        oid = self.create()
        if n:
            self.append(oid, n, positions)
        return oid

    def fork(self, oid: int) -> int:
        new = self.store.fork(oid).oid
        self.want[new] = (list(self.want[oid][0]), list(self.want[oid][1]))
        return new

    def extract(self, oid: int, ranges) -> int:
        new = self.store.extract(oid, ranges).oid
        toks, pos = self.want[oid]
        self.want[new] = ([t for a, b in ranges for t in toks[a:b]],
                          [p for a, b in ranges for p in pos[a:b]])
        return new

    def merge(self, oids) -> int:
        new = self.store.merge(oids).oid
        self.want[new] = ([t for o in oids for t in self.want[o][0]],
                          [p for o in oids for p in self.want[o][1]])
        return new

    def truncate(self, oid: int, length: int) -> None:
        self.store.truncate(oid, length)
        del self.want[oid][0][length:]
        del self.want[oid][1][length:]

    def free(self, oid: int) -> None:
        self.store.free(oid)
        del self.want[oid]

    # views
    def obj(self, oid: int):
        return self.store.get(oid)

    def page_list(self, oid: int) -> list[int]:
        return list(self.store.get(oid).pages)

    def refs(self, n: int | None = None) -> list[int]:
        rc = self.pool.refcount.tolist()
        return rc if n is None else rc[:n]

    def snapshot(self):
        objs = {o.oid: (list(o.pages), o.length, o.reserved) for o in self.store.objects.values()}
        return (objs, self.pool.refcount.tolist(), list(self.pool._free),
                self.pool.token_ids.tolist(), self.pool.positions.tolist(),
                self.pages.kv.copy(), len(self.pages.copies))

    def same(self, snap) -> bool:
        now = self.snapshot()
        return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                   for a, b in zip(snap, now))

    def verify(self) -> None:
        assert self.store.check() == []
        assert set(self.store.objects) == set(self.want)
        for oid, (toks, pos) in self.want.items():
            obj = self.store.get(oid)
            assert obj.length == len(toks)
            got_t, got_p = self.store.entries(oid)
            assert got_t.tolist() == toks, f"object {oid} tokens"
            assert got_p.tolist() == pos, f"object {oid} positions"
            kv = self.pages.read_slots(self.store.slots(obj))
            assert np.array_equal(kv, payload(toks, pos)), f"object {oid} K/V"
            assert self.store.last_position(obj) == (pos[-1] if pos else -1)


def pstr(ps: int, page: int, slots) -> list[int]:
    """Flat slot ids of `slots` in `page`."""
    return [page * ps + s for s in slots]


# ---------------------------------------------------------------- create / append

def test_create_is_empty():
    w = World()
    oid = w.create()
    obj = w.obj(oid)
    assert (obj.pages, obj.length, obj.reserved) == ([], 0, 0)
    assert w.pool.free_pages == 16
    assert w.store.last_position(obj) == -1
    t, p = w.store.entries(oid)
    assert t.tolist() == [] and p.tolist() == []
    w.verify()


def test_get_unknown_object_is_enoent():
    w = World()
    with pytest.raises(ProtocolError) as err:
        w.store.get(42)
    assert err.value.code == "ENOENT"
    for op in (lambda: w.store.fork(42), lambda: w.store.reserve(42, 1),
               lambda: w.store.truncate(42, 0), lambda: w.store.entries(42),
               lambda: w.store.extract(42, []), lambda: w.store.merge([42]),
               lambda: w.store.export(42)):
        with pytest.raises(ProtocolError) as err:
            op()
        assert err.value.code == "ENOENT"


def test_append_fills_pages_in_slot_order():
    w = World(num_pages=8, page_size=4)
    oid = w.create()
    assert w.append(oid, 10) == list(range(10))
    assert w.page_list(oid) == [0, 1, 2]
    assert w.refs() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert w.pool.free_pages == 5
    assert w.append(oid, 2) == [10, 11]          # fills page 2, no new page
    assert w.page_list(oid) == [0, 1, 2]
    assert w.append(oid, 1) == [12]
    assert w.page_list(oid) == [0, 1, 2, 3]
    assert w.pages.copies == []
    w.verify()


def test_explicit_positions_are_kept_as_given():
    w = World()
    oid = w.filled(3, positions=[7, 3, 100])
    assert w.store.entries(oid)[1].tolist() == [7, 3, 100]
    assert w.store.last_position(w.obj(oid)) == 100
    w.append(oid, 2)                               # continues after the last position
    assert w.store.entries(oid)[1].tolist() == [7, 3, 100, 101, 102]
    w.verify()


def test_reservations_accumulate_before_commit():
    w = World(num_pages=8, page_size=4)
    oid = w.create()
    assert w.store.reserve(oid, 3).tolist() == [0, 1, 2]
    assert w.store.reserve(oid, 3).tolist() == [3, 4, 5]
    obj = w.obj(oid)
    assert (obj.pages, obj.length, obj.reserved) == ([0, 1], 0, 6)
    assert w.store.check() == []
    w.pages.write_slots(np.arange(6), payload([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5]))
    w.store.commit(oid, np.array([1, 2]), np.array([0, 1]))
    assert (obj.length, obj.reserved) == (2, 4)
    assert w.store.check() == []
    w.store.commit(oid, np.array([3, 4, 5, 6]), np.array([2, 3, 4, 5]))
    assert (obj.pages, obj.length, obj.reserved) == ([0, 1], 6, 0)
    w.want[oid] = ([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
    w.verify()


def test_commit_past_reservation_is_an_internal_error():
    w = World()
    oid = w.create()
    w.store.reserve(oid, 1)
    with pytest.raises(AssertionError):
        w.store.commit(oid, np.array([1, 2]), np.array([0, 1]))


def test_release_reservation_returns_pages_past_length():
    w = World(num_pages=8, page_size=4)
    oid = w.filled(3)
    w.store.reserve(oid, 6)                       # slots 3..8: pages 0, 1, 2
    assert w.page_list(oid) == [0, 1, 2] and w.pool.free_pages == 5
    w.store.release_reservation(oid)
    obj = w.obj(oid)
    assert (obj.pages, obj.length, obj.reserved) == ([0], 3, 0)
    assert w.refs() == [1, 0, 0, 0, 0, 0, 0, 0] and w.pool.free_pages == 7
    w.store.release_reservation(oid)              # nothing reserved: no-op
    w.store.release_reservation(999)              # unknown object: no-op
    assert w.pool.free_pages == 7
    w.verify()


def test_release_reservation_after_a_partial_commit():
    w = World(num_pages=8, page_size=4)
    oid = w.create()
    slots = w.store.reserve(oid, 9)
    assert w.page_list(oid) == [0, 1, 2]
    w.pages.write_slots(slots[:5], payload([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]))
    w.store.commit(oid, np.array([1, 2, 3, 4, 5]), np.arange(5))
    w.store.release_reservation(oid)
    assert w.page_list(oid) == [0, 1] and w.obj(oid).length == 5
    assert w.pool.free_pages == 6
    w.want[oid] = ([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    w.verify()


# ---------------------------------------------------------------- fork and copy-on-write

def test_fork_of_1000_tokens_allocates_no_page_and_copies_nothing():
    w = World(num_pages=80, page_size=16)
    a = w.filled(1000)
    assert w.page_list(a) == list(range(63))
    free = w.pool.free_pages
    assert free == 17
    b = w.fork(a)
    assert w.pool.free_pages == free
    assert w.page_list(b) == list(range(63))
    assert w.refs(64) == [2] * 63 + [0]
    assert w.obj(b).length == 1000 and w.obj(b).reserved == 0
    assert w.pages.copies == []
    w.verify()


def test_first_append_to_a_fork_copies_exactly_the_partial_last_page():
    w = World(num_pages=80, page_size=16)
    a = w.filled(1000)
    b = w.fork(a)
    slots = w.append(b, 1)
    assert w.pool.free_pages == 16                       # exactly one page more
    assert w.page_list(b) == list(range(62)) + [63]
    assert w.page_list(a) == list(range(63))
    assert w.refs(64) == [2] * 62 + [1, 1]
    assert w.pages.copies == [(pstr(16, 62, range(8)), pstr(16, 63, range(8)))]
    assert slots == [63 * 16 + 8]
    # The fork owns its last page now: further appends up to the page end copy nothing.
    w.append(b, 7)
    assert w.pool.free_pages == 16 and len(w.pages.copies) == 1
    w.verify()


def test_first_append_to_a_fork_that_crosses_a_page():
    w = World(num_pages=80, page_size=16)
    a = w.filled(1000)
    b = w.fork(a)
    slots = w.append(b, 9)                       # 1000 + 9 = 1009: one page more + the CoW
    assert w.pool.free_pages == 15
    # alloc gave [63, 64]; the last one taken becomes the copy, the other is appended.
    assert w.page_list(b) == list(range(62)) + [64, 63]
    assert w.pages.copies == [(pstr(16, 62, range(8)), pstr(16, 64, range(8)))]
    assert slots == pstr(16, 64, range(8, 16)) + [63 * 16]
    assert w.refs(65) == [2] * 62 + [1, 1, 1]
    w.verify()


def test_whichever_holder_writes_first_copies():
    w = World(num_pages=8, page_size=4)
    a = w.filled(6)                              # pages 0, 1 (page 1 half full)
    b = w.fork(a)
    w.append(a, 1)                               # the source writes first: it copies
    assert w.page_list(a) == [0, 2] and w.page_list(b) == [0, 1]
    assert w.pages.copies == [([4, 5], [8, 9])]
    assert w.refs(4) == [2, 1, 1, 0]
    w.append(b, 1)                               # page 1 is b's alone now: in place
    assert w.page_list(b) == [0, 1] and len(w.pages.copies) == 1
    assert w.refs(4) == [2, 1, 1, 0]
    w.verify()


def test_fork_of_a_page_aligned_object_copies_nothing():
    w = World(num_pages=8, page_size=4)
    a = w.filled(8)
    b = w.fork(a)
    assert w.append(b, 1) == [8]
    assert w.page_list(b) == [0, 1, 2] and w.pool.free_pages == 5
    assert w.pages.copies == []
    w.verify()


def test_fork_of_an_empty_object():
    w = World(num_pages=4, page_size=4)
    a = w.create()
    b = w.fork(a)
    assert w.page_list(b) == [] and w.pool.free_pages == 4
    w.append(b, 2)
    assert w.page_list(a) == [] and w.page_list(b) == [0]
    w.verify()


def test_fork_never_sees_later_entries_of_either_side():
    w = World(num_pages=16, page_size=4)
    a = w.filled(5)
    b = w.fork(a)
    c = w.fork(b)
    w.append(a, 3)
    w.append(b, 5)
    w.append(c, 2)
    w.append(a, 4)
    assert [w.obj(o).length for o in (a, b, c)] == [12, 10, 7]
    w.verify()                                   # every object's tokens, positions, K/V


def test_fork_while_a_call_is_in_flight_shares_only_entries():
    w = World(num_pages=8, page_size=4)
    a = w.filled(5)                              # pages 0, 1
    slots = w.store.reserve(a, 6)                # slots 5..10: pages 1 (in place), 2
    assert slots.tolist() == [5, 6, 7, 8, 9, 10] and w.page_list(a) == [0, 1, 2]
    b = w.fork(a)
    assert w.page_list(b) == [0, 1] and w.obj(b).length == 5
    assert w.refs(4) == [2, 2, 1, 0]
    # the in-flight call writes its reserved slots, even those in the shared page
    toks, pos = list(range(50, 56)), list(range(5, 11))
    w.pages.write_slots(slots, payload(toks, pos))
    w.store.commit(a, np.array(toks), np.array(pos))
    w.want[a][0].extend(toks)
    w.want[a][1].extend(pos)
    w.verify()                                   # b still holds exactly its 5 entries
    w.append(b, 1)                               # b copies entry 4 of page 1
    assert w.pages.copies == [([4], [12])]
    assert w.page_list(b) == [0, 3]
    w.verify()


def test_reservation_made_before_a_fork_grows_in_place():
    """A second reservation does not copy the shared page; the fork can't see it."""
    w = World(num_pages=8, page_size=4)
    a = w.filled(5)
    s1 = w.store.reserve(a, 1)
    b = w.fork(a)
    s2 = w.store.reserve(a, 1)
    assert (s1.tolist(), s2.tolist()) == ([5], [6])
    assert w.page_list(a) == [0, 1] and w.pages.copies == []
    w.pages.write_slots([5, 6], payload([60, 61], [5, 6]))
    w.store.commit(a, np.array([60, 61]), np.array([5, 6]))
    w.want[a][0].extend([60, 61])
    w.want[a][1].extend([5, 6])
    w.verify()
    w.append(b, 2)
    assert w.page_list(b) == [0, 2] and w.pages.copies == [([4], [8])]
    w.verify()


def test_free_source_keeps_the_fork_and_everything_returns_at_the_end():
    w = World(num_pages=16, page_size=4)
    a = w.filled(10)
    b = w.fork(a)
    w.free(a)
    assert w.refs(3) == [1, 1, 1] and w.pool.free_pages == 13
    w.verify()
    w.append(b, 1)                               # b alone holds page 2: in place
    assert w.pages.copies == []
    w.free(b)
    assert w.pool.free_pages == 16 and w.refs() == [0] * 16
    w.verify()


def test_free_drops_reserved_pages_too():
    w = World(num_pages=8, page_size=4)
    a = w.filled(2)
    w.store.reserve(a, 7)
    assert w.pool.free_pages == 5
    w.store.free(a)
    del w.want[a]
    assert w.pool.free_pages == 8
    w.verify()


# ---------------------------------------------------------------- reopen (re-predict)

def test_reopen_last_of_a_private_page_copies_nothing_and_restore_undoes_it():
    w = World(num_pages=8, page_size=4)
    a = w.filled(5)                              # entry 4 alone in page 1
    assert w.store.reopen_pages(a) == 0
    token, position, saved = w.store.reopen_last(a)
    assert (token, position) == (w.want[a][0][4], 4)
    assert np.array_equal(saved, payload([token], [4]))
    o = w.obj(a)
    assert (o.length, o.reserved, o.pages) == (4, 1, [0, 1])
    assert w.pool.free_pages == 6 and w.pages.copies == []
    assert w.store.check() == []
    w.pages.write_slots([4], np.full_like(saved, 7.0))   # a failed recompute scribbles
    w.store.restore_last(a, token, position, saved)
    assert (o.length, o.reserved) == (5, 0)
    w.verify()                                   # K/V, token and position as before


def test_reopen_last_of_a_shared_page_copies_it_first():
    w = World(num_pages=8, page_size=4)
    a = w.filled(6)                              # pages 0, 1 (entries 4, 5 in page 1)
    b = w.fork(a)
    assert w.store.reopen_pages(b) == 1
    token, position, saved = w.store.reopen_last(b)
    assert (token, position) == (w.want[a][0][5], 5)
    assert w.pages.copies == [([4, 5], [8, 9])]  # the entry's own slot too
    assert w.page_list(b) == [0, 2] and w.refs(3) == [2, 1, 1]
    # Recompute entry 5 of b in place: a keeps its own.
    w.pages.write_slots([9], payload([token], [5]))
    w.store.commit(b, np.array([token]), np.array([5]))
    w.verify()


def test_reopen_last_enospc_changes_nothing():
    w = World(num_pages=2, page_size=4)
    a = w.filled(6)
    b = w.fork(a)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.store.reopen_last(b)
    assert err.value.code == "ENOSPC"
    assert w.same(snap)
    w.verify()


def test_reopen_last_of_an_empty_object_is_einval():
    w = World()
    a = w.create()
    with pytest.raises(ProtocolError) as err:
        w.store.reopen_last(a)
    assert err.value.code == "EINVAL"
    assert w.store.reopen_pages(a) == 0


def test_reopen_of_a_shared_page_then_restore_is_clean():
    w = World(num_pages=8, page_size=4)
    a = w.filled(5)
    b = w.fork(a)
    token, position, saved = w.store.reopen_last(b)   # page 1 copied to page 2
    w.store.restore_last(b, token, position, saved)
    assert w.page_list(b) == [0, 2] and w.refs(3) == [2, 1, 1]
    w.verify()


# ---------------------------------------------------------------- truncate

def test_truncate_keeps_pages_that_still_hold_entries():
    w = World(num_pages=8, page_size=4)
    a = w.filled(10)                             # pages 0, 1, 2
    w.truncate(a, 9)
    assert w.page_list(a) == [0, 1, 2]
    w.truncate(a, 8)
    assert w.page_list(a) == [0, 1] and w.pool.free_pages == 6
    w.truncate(a, 5)
    assert w.page_list(a) == [0, 1]
    w.verify()
    assert w.append(a, 2) == [5, 6]              # rewrites in place
    w.verify()
    w.truncate(a, 0)
    assert w.page_list(a) == [] and w.pool.free_pages == 8
    w.verify()


def test_truncate_out_of_range_is_einval_and_changes_nothing():
    w = World(num_pages=8, page_size=4)
    a = w.filled(6)
    snap = w.snapshot()
    for length in (7, -1):
        with pytest.raises(ProtocolError) as err:
            w.store.truncate(a, length)
        assert err.value.code == "EINVAL"
    assert w.same(snap)
    w.verify()


def test_truncate_with_a_call_in_flight_is_an_internal_error():
    w = World()
    a = w.filled(3)
    w.store.reserve(a, 1)
    with pytest.raises(AssertionError):
        w.store.truncate(a, 1)


def test_truncate_into_a_shared_page_then_append_copies_it():
    w = World(num_pages=8, page_size=4)
    a = w.filled(8)                              # pages 0, 1 full
    e = w.extract(a, [[0, 8]])                   # shares both
    assert w.page_list(e) == [0, 1] and w.refs(2) == [2, 2]
    w.truncate(a, 6)
    assert w.page_list(a) == [0, 1] and w.refs(2) == [2, 2]
    w.append(a, 1)
    assert w.page_list(a) == [0, 2]
    assert w.pages.copies == [([4, 5], [8, 9])]
    w.verify()                                   # e's entries 6, 7 untouched


def test_truncate_of_a_fork_drops_only_its_own_references():
    w = World(num_pages=8, page_size=4)
    a = w.filled(10)
    b = w.fork(a)
    w.truncate(b, 3)
    assert w.page_list(b) == [0] and w.refs(3) == [2, 1, 1]
    w.append(b, 1)                               # page 0 is shared: copy 3 entries
    assert w.page_list(b) == [3] and w.pages.copies == [([0, 1, 2], [12, 13, 14])]
    assert w.refs(4) == [1, 1, 1, 1]
    w.verify()


# ---------------------------------------------------------------- ENOSPC

def test_enospc_on_reserve_changes_nothing():
    w = World(num_pages=4, page_size=4)
    a = w.filled(6)                              # pages 0, 1
    b = w.fork(a)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:    # 6 + 7 = 13: 2 more pages + 1 CoW > 2
        w.store.reserve(b, 7)
    assert err.value.code == "ENOSPC"
    assert w.same(snap)
    w.verify()
    w.append(b, 6)                               # 12: 1 more page + 1 CoW == 2 free
    assert w.pool.free_pages == 0
    assert w.page_list(b) == [0, 3, 2]
    w.verify()


def test_enospc_when_only_the_copy_on_write_does_not_fit():
    w = World(num_pages=2, page_size=4)
    a = w.filled(6)
    b = w.fork(a)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.store.reserve(b, 1)
    assert err.value.code == "ENOSPC"
    assert w.same(snap)
    w.verify()


def test_enospc_keeps_an_earlier_reservation():
    w = World(num_pages=3, page_size=4)
    a = w.filled(2)
    w.store.reserve(a, 5)                        # slots 2..6: pages 0, 1
    snap = w.snapshot()
    with pytest.raises(ProtocolError):
        w.store.reserve(a, 10)
    assert w.same(snap)
    assert w.obj(a).reserved == 5


# ---------------------------------------------------------------- extract

def extract_world():
    w = World(num_pages=16, page_size=4)
    a = w.filled(12, positions=[10 * i for i in range(12)])   # pages 0, 1, 2
    w.pages.copies.clear()
    return w, a


def test_extract_an_aligned_whole_page_shares_it():
    w, a = extract_world()
    e = w.extract(a, [[4, 8]])
    assert w.page_list(e) == [1]
    assert w.refs(4) == [1, 2, 1, 0] and w.pool.free_pages == 13
    assert w.pages.copies == []
    assert w.store.entries(e)[1].tolist() == [40, 50, 60, 70]   # positions as stored
    w.verify()


def test_extract_several_whole_pages():
    w, a = extract_world()
    e = w.extract(a, [[0, 4], [8, 12]])
    assert w.page_list(e) == [0, 2] and w.refs(4) == [2, 1, 2, 0]
    assert w.pages.copies == []
    w.verify()


def test_extract_unaligned_range_copies():
    w, a = extract_world()
    e = w.extract(a, [[1, 5]])
    assert w.page_list(e) == [3] and w.refs(4) == [1, 1, 1, 1]
    assert w.pages.copies == [([1, 2, 3, 4], [12, 13, 14, 15])]
    w.verify()


def test_extract_shares_the_whole_page_and_copies_the_tail():
    w, a = extract_world()
    e = w.extract(a, [[0, 6]])
    assert w.page_list(e) == [0, 3] and w.refs(4) == [2, 1, 1, 1]
    assert w.pages.copies == [([4, 5], [12, 13])]
    w.verify()


def test_extract_reorders_and_keeps_positions_exactly():
    w, a = extract_world()
    e = w.extract(a, [[2, 3], [0, 2], [4, 8]])
    toks = w.want[a][0]
    assert w.store.entries(e)[0].tolist() == [toks[i] for i in (2, 0, 1, 4, 5, 6, 7)]
    assert w.store.entries(e)[1].tolist() == [20, 0, 10, 40, 50, 60, 70]
    # Destination chunks [2,0,1,4] and [5,6,7] are not source pages: both copied.
    # alloc gave [3, 4]; chunks take them from the end.
    assert w.page_list(e) == [4, 3]
    assert w.pages.copies == [([2, 0, 1, 4, 5, 6, 7], [16, 17, 18, 19, 12, 13, 14])]
    w.verify()


def test_extract_whole_page_misaligned_in_destination_is_copied():
    w, a = extract_world()
    e = w.extract(a, [[0, 1], [4, 8]])            # page 1 lands at offset 1: copied
    assert w.page_list(e) == [4, 3] and w.refs(5) == [1, 1, 1, 1, 1]
    w.verify()


def test_extract_nothing():
    w, a = extract_world()
    for ranges in ([], [[3, 3]], [[0, 0], [12, 12]]):
        e = w.extract(a, ranges)
        assert w.page_list(e) == [] and w.obj(e).length == 0
    assert w.pool.free_pages == 13
    w.verify()


def test_extract_then_append_continues_after_the_last_stored_position():
    w, a = extract_world()
    e = w.extract(a, [[4, 8]])
    w.append(e, 1)                               # page 1 is full: a fresh page, no copy
    assert w.store.entries(e)[1].tolist() == [40, 50, 60, 70, 71]
    assert w.page_list(e) == [1, 3] and w.pages.copies == []
    w.verify()


@pytest.mark.parametrize("ranges", [[[0, 13]], [[5, 4]], [[-1, 2]], [[1]], [[1, 2, 3]],
                                    [[0, 4], [0, 13]]])
def test_extract_bad_range_is_einval_and_changes_nothing(ranges):
    w, a = extract_world()
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.store.extract(a, ranges)
    assert err.value.code == "EINVAL"
    assert w.same(snap)
    w.verify()


def test_extract_enospc_is_all_or_nothing():
    w = World(num_pages=4, page_size=4)
    a = w.filled(12)                             # pages 0, 1, 2; one free
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:    # page 0 shared, [1..4] and [6..8]: 2 copies
        w.store.extract(a, [[0, 4], [1, 5], [6, 9]])
    assert err.value.code == "ENOSPC"
    assert w.same(snap)
    w.verify()
    e = w.extract(a, [[0, 4], [1, 5]])           # one copy page: fits
    assert w.page_list(e) == [0, 3] and w.pool.free_pages == 0
    w.verify()


# ---------------------------------------------------------------- merge

def merge_world():
    w = World(num_pages=16, page_size=4)
    a = w.filled(8, positions=list(range(0, 8)))          # pages 0, 1
    b = w.filled(6, positions=list(range(100, 106)))      # pages 2, 3
    w.pages.copies.clear()
    return w, a, b


def test_merge_shares_aligned_pages_and_copies_the_rest():
    w, a, b = merge_world()
    m = w.merge([a, b])
    assert w.page_list(m) == [0, 1, 2, 4]
    assert w.refs(5) == [2, 2, 2, 1, 1]
    assert w.pages.copies == [([12, 13], [16, 17])]
    assert w.store.entries(m)[1].tolist() == list(range(8)) + list(range(100, 106))
    w.verify()


def test_merge_misaligned_second_part_is_copied():
    w, a, b = merge_world()
    m = w.merge([b, a])                          # 6 + 8: only b's first page is aligned
    assert w.page_list(m) == [2, 6, 5, 4]
    assert w.refs(7) == [1, 1, 2, 1, 1, 1, 1]
    assert w.pages.copies == [([12, 13, 0, 1, 2, 3, 4, 5, 6, 7],
                               [24, 25, 26, 27, 20, 21, 22, 23, 16, 17])]
    w.verify()


def test_merge_of_one_object_and_of_none():
    w, a, b = merge_world()
    m1 = w.merge([b])
    assert w.page_list(m1) == [2, 4] and w.pages.copies == [([12, 13], [16, 17])]
    m0 = w.merge([])
    assert w.page_list(m0) == [] and w.obj(m0).length == 0
    w.verify()


def test_merged_object_is_independent_of_its_parts():
    w, a, b = merge_world()
    m = w.merge([a, b])
    w.append(m, 3)                               # writes into m's own copied page
    w.append(b, 1)                               # page 3 is b's alone: in place
    w.truncate(a, 5)
    w.append(a, 2)                               # page 1 shared with m: copy
    w.verify()
    for oid in (a, b, m):
        w.free(oid)
    assert w.pool.free_pages == 16
    w.verify()


def test_merge_unknown_object_changes_nothing():
    w, a, b = merge_world()
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.store.merge([a, 99])
    assert err.value.code == "ENOENT"
    assert w.same(snap)


def test_merge_enospc_changes_nothing():
    w = World(num_pages=4, page_size=4)
    a = w.filled(6)                              # pages 0, 1
    b = w.filled(2)                              # page 2
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:    # chunks [a0..3] shared, [a4 a5 b0 b1] copy
        w.store.merge([a, b, b])                 # + [b0 b1] copy: 2 > 1 free
    assert err.value.code == "ENOSPC"
    assert w.same(snap)
    w.verify()


def test_extract_and_merge_past_max_length_are_e2big_and_change_nothing():
    w = World(num_pages=16, page_size=4)
    a = w.filled(6)
    b = w.filled(5)
    snap = w.snapshot()
    cases = [
        (lambda: w.store.extract(a, [[0, 6], [0, 5]], max_length=10),
         "kv_extract: the new object would hold 11 entries, more than the limit of 10"),
        (lambda: w.store.merge([a, b], max_length=10),
         "kv_merge: the new object would hold 11 entries, more than the limit of 10"),
        (lambda: w.store.merge([a] * 100, max_length=10),
         "kv_merge: the new object would hold 600 entries, more than the limit of 10"),
    ]
    for call, message in cases:
        with pytest.raises(ProtocolError) as err:
            call()
        assert (err.value.code, err.value.message) == ("E2BIG", message)
        assert w.same(snap)
    # A range outside the object is EINVAL before the length is looked at.
    with pytest.raises(ProtocolError) as err:
        w.store.extract(a, [[0, 7]], max_length=1)
    assert err.value.code == "EINVAL"
    m = w.store.merge([a, b], max_length=11).oid          # exactly at the limit
    w.want[m] = (w.want[a][0] + w.want[b][0], w.want[a][1] + w.want[b][1])
    w.verify()


def test_merge_of_an_object_with_itself_is_clean():
    w = World(num_pages=8, page_size=4)
    a = w.filled(4)                              # one full page
    m = w.merge([a, a])
    assert w.obj(m).length == 8
    w.verify()                                   # check() == [] fails here


def test_extract_of_a_repeated_page_is_clean():
    w = World(num_pages=8, page_size=4)
    a = w.filled(8)
    e = w.extract(a, [[0, 4], [0, 4]])
    assert w.obj(e).length == 8
    w.verify()


def test_merge_of_an_object_with_itself_is_functionally_sound():
    """A page listed twice holds two references: entries right, refcounts exact,
    writes copy first, and check() accepts it."""
    w = World(num_pages=8, page_size=4)
    a = w.filled(4)
    m = w.merge([a, a])
    assert w.page_list(m) == [0, 0] and w.refs(2) == [3, 0]
    assert w.store.check() == []
    w.truncate(m, 6)
    w.truncate(m, 2)                             # drops one listing of page 0
    assert w.refs(2) == [2, 0]
    w.append(m, 1)                               # page 0 is still a's: copy
    assert w.page_list(m) == [1] and w.pages.copies == [([0, 1], [4, 5])]
    w.verify()
    w.free(a)
    w.free(m)
    assert w.pool.free_pages == 8


# ---------------------------------------------------------------- export / import

def test_export_import_round_trip():
    w = World(num_pages=16, page_size=4)
    a = w.filled(6, positions=[10, 11, 12, 20, 21, 22])
    blob = w.store.export(a)
    assert blob.startswith(EXPORT_MAGIC)
    (head_len,) = struct.unpack_from("<I", blob, len(EXPORT_MAGIC))
    meta = msgpack.unpackb(blob[len(EXPORT_MAGIC) + 4:len(EXPORT_MAGIC) + 4 + head_len])
    assert meta["length"] == 6 and meta["shape"] == [LAYERS, 2, 6, HEADS, DIM]
    assert meta["tokens"] == w.want[a][0] and meta["positions"] == [10, 11, 12, 20, 21, 22]
    assert meta["model"] == "fake"
    body = LAYERS * 2 * 6 * HEADS * DIM * 4
    assert len(blob) == len(EXPORT_MAGIC) + 4 + head_len + body + 4
    assert struct.unpack('<I', blob[-4:])[0] == zlib.crc32(blob[:-4])

    i = w.import_(blob).oid
    w.want[i] = (list(w.want[a][0]), list(w.want[a][1]))
    assert w.page_list(i) == [2, 3] and w.pool.free_pages == 12
    assert w.store.last_position(w.obj(i)) == 22
    w.verify()
    # into a fresh store too
    w2 = World(num_pages=4, page_size=4)
    j = w2.import_(blob).oid
    w2.want[j] = (list(w.want[a][0]), list(w.want[a][1]))
    assert w2.page_list(j) == [0, 1]
    w2.verify()


def test_export_import_with_another_page_size():
    w = World(num_pages=8, page_size=4)
    a = w.filled(7)
    blob = w.store.export(a)
    w2 = World(num_pages=8, page_size=16)
    j = w2.import_(blob).oid
    w2.want[j] = (list(w.want[a][0]), list(w.want[a][1]))
    assert w2.page_list(j) == [0]
    w2.verify()


def test_export_import_empty_object():
    w = World(num_pages=4, page_size=4)
    a = w.create()
    i = w.import_(w.store.export(a)).oid
    w.want[i] = ([], [])
    assert w.page_list(i) == []
    w.verify()


def test_import_for_another_model_is_einval():
    other = World(num_pages=4, page_size=4)
    other.pages.model = "other"
    blob = other.store.export(other.filled(3))
    w = World(num_pages=4, page_size=4)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.import_(blob)
    assert err.value.code == "EINVAL" and "model" in err.value.message
    assert w.same(snap) and w.store.objects == {}


def seal(unsealed: bytes) -> bytes:
    """An export with a valid checksum around whatever `unsealed` holds."""
    return unsealed + struct.pack("<I", zlib.crc32(unsealed))


def corrupt_blobs(blob: bytes) -> dict[str, bytes]:
    """Damaged exports; all but the first few carry a valid checksum, so that each one
    reaches the check it is about."""
    at = len(EXPORT_MAGIC)
    (head_len,) = struct.unpack_from("<I", blob, at)
    meta = msgpack.unpackb(blob[at + 4:at + 4 + head_len])
    body = blob[at + 4 + head_len:-4]
    n = meta["length"]

    def rebuild(m, data=body):
        head = msgpack.packb(m)
        return seal(EXPORT_MAGIC + struct.pack("<I", len(head)) + head + data)

    def kv_with(value: float) -> bytes:
        kv = np.frombuffer(body, np.float32).copy()
        kv[len(kv) // 2] = value
        return kv.tobytes()

    return {
        "empty": b"",
        "garbage": b"not a kv export at all",
        "magic only": EXPORT_MAGIC,
        "short length": EXPORT_MAGIC + b"\x01\x00",
        "old format": b"SYKV1\n" + blob[at:-4],
        "checksum wrong": blob[:-4] + struct.pack("<I", zlib.crc32(blob[:-4]) ^ 1),
        "truncated": blob[:-1],
        "flipped header byte": blob[:at + 6] + bytes([blob[at + 6] ^ 0x20]) + blob[at + 7:],
        "flipped K/V byte": blob[:-9] + bytes([blob[-9] ^ 1]) + blob[-8:],
        "huge head": seal(EXPORT_MAGIC + struct.pack("<I", 1 << 30) + blob[at + 4:-4]),
        "zero head": seal(EXPORT_MAGIC + struct.pack("<I", 0) + blob[at + 4:-4]),
        "head not msgpack": seal(EXPORT_MAGIC + struct.pack("<I", 3) + b"\xc1\xc1\xc1" + body),
        "head not a map": rebuild([1, 2, 3]),
        "no length": rebuild({k: v for k, v in meta.items() if k != "length"}),
        "length not an int": rebuild({**meta, "length": float(n)}),
        "length a bool": rebuild({**meta, "length": True}),
        "length negative": rebuild({**meta, "length": -1}),
        "no shape": rebuild({k: v for k, v in meta.items() if k != "shape"}),
        "length mismatch": rebuild({**meta, "length": n + 1}),
        "tokens short": rebuild({**meta, "tokens": meta["tokens"][:-1]}),
        "tokens not ints": rebuild({**meta, "tokens": [0.5] * n}),
        "tokens bools": rebuild({**meta, "tokens": [True] * n}),
        "tokens not a list": rebuild({**meta, "tokens": b"\x01" * n}),
        "positions short": rebuild({**meta, "positions": meta["positions"][:-1]}),
        "shape mismatch": rebuild({**meta, "shape": [LAYERS, 2, 4, HEADS, DIM]}),
        # Same number of elements but another geometry: once, this reserved pages and
        # then failed to write them (a leak).
        "shape of another geometry": rebuild(
            {**meta, "shape": [LAYERS, 2, n, HEADS, DIM * 2]}, body + body),
        "shape reordered": rebuild({**meta, "shape": [LAYERS, 2, HEADS, n, DIM]}),
        "data short by a row": rebuild(meta, body[:-4 * DIM]),
        "data extra": rebuild(meta, body + b"\0" * 4),
        "token too big": rebuild({**meta, "tokens": [1 << 40] + meta["tokens"][1:]}),
        "token past the vocabulary": rebuild({**meta, "tokens": [VOCAB] + meta["tokens"][1:]}),
        "token negative": rebuild({**meta, "tokens": [-1] + meta["tokens"][1:]}),
        "position negative": rebuild({**meta, "positions": [-1] + meta["positions"][1:]}),
        "position past int32": rebuild(
            {**meta, "positions": [MAX_POSITION] + meta["positions"][1:]}),
        "NaN K/V": rebuild(meta, kv_with(float("nan"))),
        "infinite K/V": rebuild(meta, kv_with(float("inf"))),
        "dtype": rebuild({**meta, "dtype": "bfloat16"}),
        "model": rebuild({**meta, "model": "other"}),
        "layers": rebuild({**meta, "layers": LAYERS + 1}),
        "head_dim": rebuild({**meta, "head_dim": DIM * 2}),
    }


def _case_names() -> list[str]:
    w = World()
    return list(corrupt_blobs(w.store.export(w.filled(3))))


NOT_AN_EXPORT = "not a Symphony KV export"
CHECKSUM = "checksum mismatch"
LENGTH, SHAPE = "corrupt KV export: length", "corrupt KV export: shape"
K_V_SIZE, NON_FINITE = "bytes of K/V, expected", "NaN or infinite K/V"
# What the EINVAL message of each damaged export names.
EXPECTED_MESSAGE = {
    "empty": NOT_AN_EXPORT, "garbage": NOT_AN_EXPORT, "magic only": NOT_AN_EXPORT,
    "short length": NOT_AN_EXPORT, "old format": NOT_AN_EXPORT,
    "checksum wrong": CHECKSUM, "truncated": CHECKSUM, "flipped header byte": CHECKSUM,
    "flipped K/V byte": CHECKSUM,
    "huge head": "a header of", "zero head": "header is not msgpack",
    "head not msgpack": "header is not msgpack", "head not a map": "header is not a map",
    "no length": LENGTH, "length not an int": LENGTH, "length a bool": LENGTH,
    "length negative": LENGTH,
    "no shape": SHAPE, "length mismatch": SHAPE, "shape mismatch": SHAPE,
    "shape of another geometry": SHAPE, "shape reordered": SHAPE,
    "tokens short": "tokens: expected a list of 3",
    "tokens not a list": "tokens: expected a list of 3",
    "tokens not ints": "tokens: expected integers", "tokens bools": "tokens: expected integers",
    "positions short": "positions: expected a list of 3",
    "data short by a row": K_V_SIZE, "data extra": K_V_SIZE,
    "token too big": "tokens: out of range [0, 65536)",
    "token past the vocabulary": "tokens: out of range [0, 65536)",
    "token negative": "tokens: out of range [0, 65536)",
    "position negative": f"positions: out of range [0, {MAX_POSITION})",
    "position past int32": f"positions: out of range [0, {MAX_POSITION})",
    "NaN K/V": NON_FINITE, "infinite K/V": NON_FINITE,
    "dtype": "export is for dtype='bfloat16', this predd has 'float32'",
    "model": "export is for model='other', this predd has 'fake'",
    "layers": "export is for layers=3", "head_dim": "export is for head_dim=8",
}


@pytest.mark.parametrize("case", _case_names())
def test_import_garbage_is_einval_and_changes_nothing(case):
    src = World(num_pages=4, page_size=4)
    blob = corrupt_blobs(src.store.export(src.filled(3)))[case]
    w = World(num_pages=4, page_size=4)
    keep = w.filled(2)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.import_(blob)
    assert err.value.code == "EINVAL", case
    assert EXPECTED_MESSAGE[case] in err.value.message, (case, err.value.message)
    assert w.same(snap) and set(w.store.objects) == {keep} and w.pool.free_pages == 3
    w.verify()


def test_import_longer_than_the_limit_is_e2big_and_changes_nothing():
    src = World(num_pages=8, page_size=4)
    blob = src.store.export(src.filled(5))
    w = World(num_pages=8, page_size=4)
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.store.import_(blob, VOCAB, 4)
    assert (err.value.code, err.value.message) == (
        "E2BIG", "export of 5 entries: more than the limit of 4")
    assert w.same(snap) and w.store.objects == {} and w.pool.free_pages == 8
    i = w.store.import_(blob, VOCAB, 5).oid                 # exactly at the limit
    w.want[i] = (list(src.want[1][0]), list(src.want[1][1]))
    w.verify()


def test_import_whose_write_fails_takes_no_page():
    """Defence in depth: if writing K/V fails after the pages are reserved, the new
    object is freed again (an exception from the cache, not a bad blob)."""
    src = World(num_pages=8, page_size=4)
    blob = src.store.export(src.filled(6))
    w = World(num_pages=8, page_size=4)

    def broken(slots, data):
        raise RuntimeError("device lost")

    w.pages.write_slots = broken
    with pytest.raises(RuntimeError):
        w.import_(blob)
    assert w.store.objects == {} and w.pool.free_pages == 8
    assert w.store.check() == []


def test_import_enospc_changes_nothing():
    src = World(num_pages=8, page_size=4)
    blob = src.store.export(src.filled(9))          # needs 3 pages
    w = World(num_pages=4, page_size=4)
    keep = w.filled(5)                              # 2 pages used, 2 free
    snap = w.snapshot()
    with pytest.raises(ProtocolError) as err:
        w.import_(blob)
    assert err.value.code == "ENOSPC"
    assert w.same(snap) and set(w.store.objects) == {keep}
    w.verify()


# ---------------------------------------------------------------- reading, check

def test_entries_ranges():
    w = World()
    a = w.filled(6, positions=[5, 6, 7, 8, 9, 10])
    t, p = w.store.entries(a, 2, 4)
    assert t.tolist() == w.want[a][0][2:4] and p.tolist() == [7, 8]
    assert w.store.entries(a, 6)[0].tolist() == []
    for start, end in ((-1, 2), (3, 2), (0, 7), (7, None)):
        with pytest.raises(ProtocolError) as err:
            w.store.entries(a, start, end)
        assert err.value.code == "EINVAL"


def test_slots_of_an_object():
    w = World(num_pages=8, page_size=4)
    a = w.filled(6)
    b = w.fork(a)
    w.append(b, 1)
    assert w.store.slots(w.obj(b)).tolist() == [0, 1, 2, 3, 8, 9, 10]
    assert w.store.slots(w.obj(b), 3, 5).tolist() == [3, 8]


def test_check_finds_a_missing_reference():
    w = World(num_pages=4, page_size=4)
    a = w.filled(5)
    w.obj(a).pages.append(3)                     # a page the object never took
    problems = w.store.check()
    assert f"object {a}: 3 pages for 5+0 entries" in problems
    assert "page 3: refcount 0, referenced 1 times" in problems


def test_check_finds_a_leaked_page():
    w = World(num_pages=4, page_size=4)
    w.filled(5)
    w.pool.alloc(1)
    assert "page 2: refcount 1, referenced 0 times" in w.store.check()


# ---------------------------------------------------------------- a seeded random walk

def test_random_operations_keep_every_invariant():
    rng = random.Random(1234)
    w = World(num_pages=24, page_size=4)
    for _ in range(250):
        oids = sorted(w.want)
        op = rng.choice(["create", "append", "append", "append", "fork", "truncate",
                         "extract", "merge", "free", "free", "export"])
        before = w.snapshot()
        try:
            if op == "create" or not oids:
                w.create()
            elif op == "append":
                w.append(rng.choice(oids), rng.randint(1, 9))
            elif op == "fork":
                w.fork(rng.choice(oids))
            elif op == "truncate":
                o = rng.choice(oids)
                w.truncate(o, rng.randint(0, w.obj(o).length))
            elif op == "extract":
                o = rng.choice(oids)
                n = w.obj(o).length
                ranges = []
                for _ in range(rng.randint(0, 3)):
                    a = rng.randint(0, n)
                    ranges.append([a, rng.randint(a, n)])
                w.extract(o, ranges)
            elif op == "merge":
                picked = rng.sample(oids, rng.randint(1, min(3, len(oids))))
                w.merge(picked)
            elif op == "free":
                w.free(rng.choice(oids))
            elif op == "export":
                o = rng.choice(oids)
                i = w.import_(w.store.export(o)).oid
                w.want[i] = (list(w.want[o][0]), list(w.want[o][1]))
        except ProtocolError as exc:
            assert exc.code == "ENOSPC"
            assert w.same(before), op
        w.verify()
    for oid in list(w.want):
        w.free(oid)
    assert w.pool.free_pages == 24
    w.verify()


def test_non_finite_k_v_is_found_in_every_dtype():
    """bfloat16 travels as raw uint16 bits: an all-ones exponent is inf or NaN."""
    from predd.memory.kvstore import _finite
    bf16 = np.array([0x3F80, 0x0000, 0x8000, 0x7F7F, 0x0001], np.uint16)   # 1, ±0, max, tiny
    assert _finite(bf16, "bfloat16")
    for bits in (0x7F80, 0xFF80, 0x7FC0, 0xFFC1):                          # ±inf, NaNs
        assert not _finite(np.append(bf16, np.uint16(bits)), "bfloat16")
    for dtype in ("float32", "float16"):
        ok = np.array([1.0, -0.0, 6e4], dtype)
        assert _finite(ok, dtype)
        for bad in (np.inf, -np.inf, np.nan):
            assert not _finite(np.append(ok, np.array([bad], dtype)), dtype)


def test_page_tables_are_each_object_s_device_slots_from_one_lookup():
    """A step's page tables at once: each object's pages holding its first `length`
    entries (a reservation included), as device slots, int32; an empty object has none."""
    w = World(num_pages=32, page_size=4)
    a = w.filled(10)                             # 3 pages
    b = w.fork(a)                                # the same pages
    w.store.reserve(b, 3)                        # a copy of the last page, and one more
    c = w.store.create()
    objs = [w.store.get(a), w.store.get(b), c]
    tables = w.store.page_tables([(objs[0], 10), (objs[1], 13), (objs[2], 0)])
    pool = w.store.pool
    want = [pool.slot[objs[0].pages[:3]], pool.slot[objs[1].pages[:4]], []]
    assert [t.dtype for t in tables] == [np.int32] * 3
    assert [t.tolist() for t in tables] == [list(x) for x in want]
    assert tables[0].tolist() != tables[1].tolist()[:3]      # b's third page is its own
    assert w.store.page_tables([(objs[0], 5)])[0].tolist() == list(want[0][:2])
