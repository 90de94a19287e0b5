"""Quota counters over a real KV store: exact through every path that changes a page
list (create, reserve with copy-on-write, commit, truncate, release, fork, extract,
merge, import, free), O(1) checks, and `verify` catching a counter that drifted."""
from __future__ import annotations

import numpy as np

from predd.memory.kvstore import KVStore
from predd.memory.pool import Pool
from predd.server.quotas import QuotaConfig, Quotas
from tests.unit.helpers import code
from tests.unit.predd.kvstore_world import FakePages, payload

PS = 4          # tokens per page
ME = 0          # the daemon's own uid in these tests


def make(pages=64, **limits) -> tuple[KVStore, Quotas]:
    quotas = Quotas(QuotaConfig(**limits), pages, exempt_uid=ME)
    store = KVStore(Pool(pages, PS), FakePages(pages, PS), on_resize=quotas.resized)
    return store, quotas


def append(store: KVStore, oid: int, n: int) -> None:
    """What a pred of n tokens does to the object: reserve, then commit."""
    obj = store.get(oid)
    first = store.last_position(obj) + 1
    slots = store.reserve(oid, n)
    tokens = np.arange(1, n + 1, dtype=np.int32)
    positions = np.arange(first, first + n, dtype=np.int32)
    store.data.write_slots(slots, payload(tokens, positions))
    store.commit(oid, tokens, positions)


def new(store: KVStore, quotas: Quotas, obj, session: int | None, uid: int) -> int:
    quotas.charge(obj.oid, len(obj.pages), session, uid)
    return obj.oid


def figures(q: Quotas) -> tuple[dict, dict, dict, dict]:
    return q.pages_of_uid, q.pages_of_session, q.objects_of_uid, q.objects_of_session


def test_counters_follow_every_page_list_change():
    store, q = make()
    a = new(store, q, store.create(), 1, 1000)
    assert figures(q) == ({}, {}, {1000: 1}, {1: 1})
    append(store, a, 6)                                   # 2 pages
    assert figures(q) == ({1000: 2}, {1: 2}, {1000: 1}, {1: 1})
    b = new(store, q, store.fork(a), 2, 1000)             # shares both: counts twice
    assert q.pages_of_uid == {1000: 4} and q.pages_of_session == {1: 2, 2: 2}
    append(store, b, 1)                                   # copy-on-write of the last page
    assert store.get(b).pages[1] != store.get(a).pages[1]
    assert q.pages_of_uid == {1000: 4} and q.pages_of_session == {1: 2, 2: 2}
    append(store, b, 4)                                   # 11 entries: 3 pages
    assert q.pages_of_uid == {1000: 5} and q.pages_of_session == {1: 2, 2: 3}
    store.reserve(a, 5)                                   # a reservation holds pages too
    assert q.pages_of_session == {1: 3, 2: 3}
    store.release_reservation(a)
    assert q.pages_of_session == {1: 2, 2: 3}
    store.truncate(b, 3)
    assert q.pages_of_uid == {1000: 3} and q.pages_of_session == {1: 2, 2: 1}
    c = new(store, q, store.extract(a, [[0, 4], [5, 6]]), None, 65534)   # persistent
    assert q.pages_of_uid == {1000: 3, 65534: 2} and q.pages_of_session == {1: 2, 2: 1}
    d = new(store, q, store.merge([a, b]), 1, 1000)       # 6 + 3 entries: 3 pages
    assert q.pages_of_uid == {1000: 6, 65534: 2} and q.pages_of_session == {1: 5, 2: 1}
    e = new(store, q, store.import_(store.export(a), 1 << 16, 1 << 16), 2, 65534)
    assert q.pages_of_uid == {1000: 6, 65534: 4} and q.objects_of_uid == {1000: 3, 65534: 2}
    assert q.verify(store.objects) == []
    for oid in (a, b, c, d, e):
        q.forget(oid)
        store.free(oid)
        assert q.verify(store.objects) == []
    assert figures(q) == ({}, {}, {}, {})
    assert store.pool.free_pages == 64


def test_free_before_forget_counts_the_same():
    store, q = make()
    a = new(store, q, store.create(), 1, 1000)
    append(store, a, 9)
    store.free(a)                     # the store reports -3 pages first
    assert q.pages_of_uid == {} and q.objects_of_uid == {1000: 1}
    q.forget(a)
    assert figures(q) == ({}, {}, {}, {})


def test_objects_not_charged_yet_are_not_counted():
    store, q = make()
    obj = store.create()
    append(store, obj.oid, 8)         # e.g. kv_import fills before it is charged
    assert q.pages_of_uid == {}
    assert q.verify(store.objects) == [f"object {obj.oid} is charged to nobody"]
    new(store, q, obj, 1, 7)
    assert q.pages_of_uid == {7: 2} and q.verify(store.objects) == []


def test_page_limits_per_session_and_uid():
    store, q = make(session_pages=3, uid_pages=5)
    a = new(store, q, store.create(), 1, 1000)
    q.check(a, 3)
    assert code(lambda: q.check(a, 4)) == "EDQUOT"
    append(store, a, 12)                                  # 3 pages: the session's all
    assert code(lambda: q.check(a, 1)) == "EDQUOT"
    b = new(store, q, store.create(), 2, 1000)
    q.check(b, 2)                                         # uid: 3 + 2 = 5
    assert code(lambda: q.check(b, 3)) == "EDQUOT"        # uid would hold 6
    c = new(store, q, store.create(), 3, 2000)
    q.check(c, 3)                                         # another uid: its own count
    p = new(store, q, store.create(), None, 1000)         # persistent: no session limit
    assert code(lambda: q.check(p, 3)) == "EDQUOT"        # but the uid's
    q.check(p, 2)


def test_the_daemons_uid_is_exempt_from_uid_limits_only():
    store, q = make(session_pages=2, uid_pages=1, uid_objects=1)
    p = new(store, q, store.create(), None, ME)
    new(store, q, store.create(), None, ME)
    q.check(p, 50)                                        # no uid page or object limit
    s = new(store, q, store.create(), 9, ME)
    assert code(lambda: q.check(s, 3)) == "EDQUOT"        # the session limit holds


def test_object_limits():
    store, q = make(session_objects=2, uid_objects=3)
    new(store, q, store.create(), 1, 1000)
    b = new(store, q, store.create(), 1, 1000)
    q.check(b)
    c = new(store, q, store.create(), 1, 1000)            # the session's third
    assert code(lambda: q.check(c)) == "EDQUOT"
    q.forget(c)
    store.free(c)
    d = new(store, q, store.create(), 2, 1000)            # the uid's third
    q.check(d)
    e = new(store, q, store.create(), 3, 1000)
    assert code(lambda: q.check(e)) == "EDQUOT"


def test_default_uid_limit_is_half_the_pool_and_zero_means_none():
    assert Quotas(QuotaConfig(), 2048, ME).uid_pages == 1024
    assert Quotas(QuotaConfig(uid_pages=0), 2048, ME).uid_pages == 0
    store, q = make(uid_pages=0, uid_objects=0, session_objects=0)
    a = new(store, q, store.create(), 1, 1000)
    q.check(a, 10**6)


def test_verify_reports_a_drifted_counter():
    store, q = make()
    a = new(store, q, store.create(), 1, 1000)
    append(store, a, 5)
    q.pages_of_uid[1000] += 1
    assert q.verify(store.objects) == [
        "quota counters of pages per uid are {1000: 3}, recounted {1000: 2}"]
    q.pages_of_uid[1000] -= 1
    q.charges[a].pages = 1
    assert f"object {a}: 2 pages, 1 charged" in q.verify(store.objects)
