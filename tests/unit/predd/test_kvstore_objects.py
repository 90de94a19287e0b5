"""KV objects over the page pool: create and append (reserve, commit), reopening the
last entry, truncate, ENOSPC, reading entries and `check`, a seeded random walk."""
from __future__ import annotations

import random

import numpy as np
import pytest

from symphony_protocol import ProtocolError
from tests.unit.predd.kvstore_world import payload, World


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
