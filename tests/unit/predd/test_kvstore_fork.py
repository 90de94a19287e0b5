"""KV objects: fork and copy-on-write (a fork copies nothing until one side writes a
shared partial page; freeing either side keeps the other)."""
from __future__ import annotations


import numpy as np

from tests.unit.predd.kvstore_world import payload, World, pstr


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
