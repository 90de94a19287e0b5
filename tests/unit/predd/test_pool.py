"""The page pool: free list order, refcounts, ENOSPC, and `check`."""
from __future__ import annotations

import pytest

from symphony_protocol import ProtocolError
from predd.memory.pool import Pool


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        Pool(0, 16)
    with pytest.raises(ValueError):
        Pool(4, 0)


def test_fresh_pool_is_all_free_and_clean():
    pool = Pool(8, 16)
    assert (pool.free_pages, pool.used_pages) == (8, 0)
    assert pool.refcount.tolist() == [0] * 8
    assert pool.token_ids.shape == (8, 16) and pool.positions.shape == (8, 16)
    assert pool.check({}) == []


def test_alloc_hands_out_low_ids_first_with_refcount_one():
    pool = Pool(8, 4)
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(0) == []
    assert pool.alloc(2) == [3, 4]
    assert pool.refcount.tolist() == [1, 1, 1, 1, 1, 0, 0, 0]
    assert (pool.free_pages, pool.used_pages) == (3, 5)
    assert pool.check({0: 1, 1: 1, 2: 1, 3: 1, 4: 1}) == []


def test_freed_pages_are_reused_last_freed_first():
    pool = Pool(6, 4)
    pool.alloc(4)                 # 0 1 2 3
    pool.decref([1])
    pool.decref([3])
    assert pool.free_pages == 4
    assert pool.alloc(3) == [3, 1, 4]
    assert pool.check({0: 1, 1: 1, 2: 1, 3: 1, 4: 1}) == []


def test_refcounts_and_return_to_free_list_at_zero():
    pool = Pool(4, 4)
    [a, b] = pool.alloc(2)
    pool.incref([a, a, b])
    assert pool.refcount.tolist() == [3, 2, 0, 0]
    pool.decref([a, b])
    assert pool.refcount.tolist() == [2, 1, 0, 0]
    assert pool.free_pages == 2
    pool.decref([b])
    assert pool.refcount.tolist() == [2, 0, 0, 0]
    assert pool.free_pages == 3
    assert pool.check({a: 2}) == []
    pool.decref([a, a])
    assert pool.free_pages == 4 and pool.used_pages == 0
    assert pool.check({}) == []


def test_one_decref_frees_pages_in_list_order_and_keeps_shared_ones():
    pool = Pool(6, 4)
    pool.alloc(4)                 # 0 1 2 3
    pool.incref([3])
    pool.decref([2, 0, 3, 1])     # 3 is still referenced once
    assert pool.refcount.tolist() == [0, 0, 0, 1, 0, 0]
    assert pool.alloc(3) == [1, 0, 2]         # freed 2, 0, 1: the last freed first
    assert pool.check({0: 1, 1: 1, 2: 1, 3: 1}) == []


def test_enospc_takes_nothing():
    pool = Pool(4, 4)
    pool.alloc(3)
    free_before = list(pool._free)
    with pytest.raises(ProtocolError) as err:
        pool.alloc(2)
    assert err.value.code == "ENOSPC"
    assert pool._free == free_before
    assert pool.refcount.tolist() == [1, 1, 1, 0]
    assert pool.alloc(1) == [3]
    with pytest.raises(ProtocolError) as err:
        pool.alloc(1)
    assert err.value.code == "ENOSPC"


def test_incref_or_decref_of_a_free_page_is_an_internal_error():
    pool = Pool(2, 4)
    with pytest.raises(AssertionError):
        pool.incref([0])
    with pytest.raises(AssertionError):
        pool.decref([1])
    assert pool.check({}) == []


def test_check_reports_refcount_mismatch():
    pool = Pool(4, 4)
    pool.alloc(2)
    problems = pool.check({0: 1, 1: 2})
    assert problems == ["page 1: refcount 1, referenced 2 times"]


def test_check_reports_a_used_page_nobody_references():
    pool = Pool(4, 4)
    pool.alloc(2)
    problems = pool.check({0: 1})
    assert "page 1: refcount 1, referenced 0 times" in problems
    assert "page 1: free=False but referenced 0 times" in problems
    assert "free 2 + referenced 1 != 4" in problems


def test_check_reports_a_referenced_free_page():
    pool = Pool(3, 4)
    problems = pool.check({2: 1})
    assert "page 2: refcount 0, referenced 1 times" in problems
    assert "page 2: free=True but referenced 1 times" in problems


def test_check_reports_a_page_on_the_free_list_twice():
    pool = Pool(3, 4)
    pool._free.append(0)
    assert "free list holds a page twice" in pool.check({})
