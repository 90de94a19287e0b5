"""KV objects: extract and merge (whole aligned pages shared, the rest copied; all or
nothing)."""
from __future__ import annotations


import pytest

from symphony_protocol import ProtocolError
from tests.unit.predd.kvstore_world import World


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
