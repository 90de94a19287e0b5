"""Memory tiers and their policy (predd/memory/policy.py, tiers.py, pool.py) through a real
Engine over the fake runner, whose outputs depend on every K/V entry they attend to:
a page that comes back from the host or the disk changed by one bit changes the logits.

The device pool here is 8 pages of 4 slots; caches of 14 entries take 4 pages each."""
from __future__ import annotations

import time

import numpy as np
import pytest

from predd.memory.policy import MemoryConfig
from predd.memory.pool import DEVICE, DISK, HOST
from tests.unit.engine_fakes import Harness

A, B = b"client-a", b"client-b"
DOC = 14   # entries per cache: 4 pages of 4


def tiered(tmp_path, host: int = 16, disk: int = 16, **memory) -> Harness:
    return Harness(kv_pages=8, page_size=4,
                   memory=MemoryConfig(host_pages=host, disk_pages=disk,
                                       swap_dir=str(tmp_path), **memory))


def doc(i: int) -> list[int]:
    return [(7 * i + j) % 60 + 1 for j in range(DOC)]


def cache(h: Harness, who: bytes, tokens: list[int]) -> str:
    kv = h.ok(who, "kv_create")["cap"]
    h.ok(who, "pred", cap=kv, tokens=tokens, outputs=[])
    return kv


def logits(h: Harness, who: bytes, cap: str, tokens: list[int]) -> tuple[bytes, dict]:
    rid = h.send(who, "pred", cap=cap, tokens=tokens)
    h.drain()
    [(head, frames)] = [(r, f) for i, r, f in h.replies if i == who and r["rid"] == rid]
    assert head["ok"], head
    return frames[0], head["cost"]


def tiers_of(h: Harness, cap: str) -> list[int]:
    obj = h.engine.store.get(h.engine.caps.lookup(cap).oid)
    return [int(h.engine.pool.tier[p]) for p in obj.pages]


def moves(h: Harness) -> tuple[int, int]:
    m = h.engine.memory.moves
    return m.down, m.up


def workload(h: Harness, n: int) -> tuple[list[str], list[list[int]]]:
    """n caches of DOC entries, then a short generate on each, in order: with n = 8, the
    caches are 4x the device pool."""
    caps = [cache(h, A, doc(i)) for i in range(n)]
    out = [h.ok(A, "generate", cap=kv, tokens=[5], max_tokens=2, stop=[],
                stream=False)["tokens"] for kv in caps]
    return caps, out


def test_caches_four_times_the_device_pool_give_the_tokens_of_a_big_pool(tmp_path):
    big = Harness(kv_pages=64, page_size=4)
    caps_big, want = workload(big, 8)
    h = tiered(tmp_path)
    caps, got = workload(h, 8)
    assert got == want
    for kv, kv_big in zip(caps, caps_big):   # every entry, bit for bit, wherever it is
        assert h.entries(kv) == big.entries(kv_big)
        assert np.array_equal(h.kv_of(kv), big.kv_of(kv_big))
    down, up = moves(h)
    # 32 pages of caches on 8 device pages: every cache was pushed down and brought back
    assert down >= 24 and up >= 24
    stats = h.ok(A, "stats")
    assert stats["pages_moved_down"] == down and stats["pages_moved_up"] == up
    assert stats["bytes_moved"] == (down + up) * h.engine.tiers.bytes_per_page
    used = {t: stats["tiers"][t]["pages_used"] for t in ("device", "host", "disk")}
    assert sum(used.values()) == 32 and used["device"] <= 8
    assert {t: stats["tiers"][t]["pages_total"] for t in used} == \
        {"device": 8, "host": 16, "disk": 16}
    h.clean()


def test_the_host_spills_to_disk_and_disk_pages_come_back_bit_exact(tmp_path):
    big = Harness(kv_pages=64, page_size=4)
    h = tiered(tmp_path, host=4, disk=32)
    caps = [cache(h, A, doc(i)) for i in range(6)]       # 24 pages: 8 + 4 + 12
    assert sorted(sum((tiers_of(h, kv) for kv in caps), [])) == \
        [DEVICE] * 8 + [HOST] * 4 + [DISK] * 12
    assert tiers_of(h, caps[0]) == [DISK] * 4            # the coldest went furthest
    assert h.ok(A, "kv_stat", cap=caps[0])["tier"] == "disk"
    ref = cache(big, A, doc(0))
    got, cost = logits(h, A, caps[0], [9])
    assert got == logits(big, A, ref, [9])[0]
    assert cost["swapped_in"] == DOC and cost["swap_ms"] >= 0
    assert tiers_of(h, caps[0]) == [DEVICE] * 4                # 15 entries: still 4 pages
    h.clean()


def test_evict_moves_a_cache_down_and_the_next_pred_brings_back_the_same_logits(tmp_path):
    h = tiered(tmp_path)
    kv = cache(h, A, doc(1))
    probe = h.ok(A, "kv_fork", cap=kv)["cap"]
    want, cost = logits(h, A, probe, [9])
    assert cost["swapped_in"] == 0
    stat = h.ok(A, "kv_policy", cap=kv, evict=True)
    assert (stat["tier"], stat["pinned"], stat["tokens"]) == ("host", False, DOC)
    assert tiers_of(h, kv) == [HOST] * 4
    # the probe shared kv's first three pages: they moved with it, still shared
    assert tiers_of(h, probe)[:3] == [HOST] * 3
    again = h.ok(A, "kv_fork", cap=kv)["cap"]              # a fork moves nothing
    assert tiers_of(h, again) == [HOST] * 4
    got, cost = logits(h, A, again, [9])
    assert got == want and cost["swapped_in"] == DOC
    assert h.ok(A, "kv_stat", cap=kv)["tier"] == "device"  # shared pages came back
    h.clean()


def test_pinned_caches_never_move_and_pins_past_the_quota_get_edquot(tmp_path):
    h = tiered(tmp_path, pin_pages=4)
    hot = cache(h, A, doc(0))
    assert h.ok(A, "kv_policy", cap=hot, pin=True)["pinned"] is True
    second = cache(h, A, doc(1))
    reply = h.call(A, "kv_policy", cap=second, pin=True)
    assert reply["error"] == {"code": "EDQUOT", "message": f"uid {h.engine.sessions.of_identity(A).uid} "
                              "has 4 pages pinned; pinning 4 more passes the pin quota of 4"}
    assert h.ok(A, "kv_stat", cap=second)["pinned"] is False
    workload(h, 6)                                          # pressure: others move, not it
    assert tiers_of(h, hot) == [DEVICE] * 4
    assert h.call(A, "kv_policy", cap=hot, evict=True)["error"]["code"] == "EBUSY"
    h.ok(A, "kv_policy", cap=hot, pin=False)
    assert h.ok(A, "kv_policy", cap=hot, evict=True)["tier"] in ("host", "disk")
    h.clean()


def test_a_pin_flood_stops_at_half_the_pool_and_the_others_keep_being_served(tmp_path):
    h = tiered(tmp_path, pin_pages=8)                       # the uid may pin all 8...
    first = cache(h, A, doc(0))
    h.ok(A, "kv_policy", cap=first, pin=True)
    flood = [cache(h, A, doc(i)) for i in range(1, 4)]
    for kv in flood:                                        # ...but all uids only 4
        assert h.call(A, "kv_policy", cap=kv, pin=True)["error"] == {
            "code": "EDQUOT", "message": "4 pages are pinned; pinning 4 more passes the "
            "limit of 4 (half the device pool) for all users together"}
    kv_b = cache(h, B, doc(9))                              # B is served: room is made
    assert h.ok(B, "generate", cap=kv_b, tokens=[1], max_tokens=2, stop=[],
                stream=False)["generated"] == 2
    assert tiers_of(h, first) == [DEVICE] * 4
    h.clean()


def test_policy_needs_a_writable_capability_and_evict_needs_somewhere_to_go(tmp_path):
    h = Harness(kv_pages=8, page_size=4)
    kv = cache(h, A, doc(0))
    ro = h.ok(A, "kv_fork", cap=kv, rights="r")["cap"]
    assert h.call(A, "kv_policy", cap=ro, pin=True)["error"]["code"] == "EACCES"
    assert h.call(A, "kv_policy", cap=ro, evict=True)["error"]["code"] == "EACCES"
    assert h.call(A, "kv_policy", cap=kv, pin=True, evict=True)["error"]["code"] == "EINVAL"
    assert h.call(A, "kv_policy", cap=kv, evict=True)["error"] == {
        "code": "ENOSPC", "message": "no host or disk tier to move the cache to "
        "(predd --host-pages / --disk-pages)"}
    h.clean()


def test_caches_of_a_session_waiting_on_io_move_down_first(tmp_path):
    h = tiered(tmp_path)
    old = cache(h, A, doc(0))          # least recently used
    waiting = cache(h, B, doc(1))      # newer, but B says it waits on I/O
    h.ok(B, "io_wait", on=True)
    cache(h, A, doc(2))                # needs 4 of the 8 device pages
    assert tiers_of(h, waiting) == [HOST] * 4 and tiers_of(h, old) == [DEVICE] * 4
    h.ok(B, "io_wait", on=False)
    cache(h, A, doc(3))                # now plain LRU: the oldest goes
    assert tiers_of(h, old) == [HOST] * 4
    h.clean()


def test_io_wait_naming_caches_marks_those_alone(tmp_path):
    h = tiered(tmp_path)
    old = cache(h, A, doc(0))
    named = cache(h, A, doc(1))
    h.ok(A, "io_wait", on=True, caps=[named])
    cache(h, A, doc(2))
    assert tiers_of(h, named) == [HOST] * 4 and tiers_of(h, old) == [DEVICE] * 4
    assert h.call(A, "io_wait", on=True, caps=["f" * 32])["error"]["code"] == "EBADF"
    h.clean()


def test_a_call_with_no_room_waits_in_the_queue_and_runs_when_room_comes():
    h = Harness(kv_pages=4, page_size=4)
    kv_a = cache(h, A, doc(0))                               # all 4 pages
    kv_b = h.ok(B, "kv_create")["cap"]
    rid = h.send(B, "pred", cap=kv_b, tokens=[1, 2, 3], topk=1)
    assert not h.engine.step()                               # no room: it waits
    assert h.engine.scheduler.pending() == 1 and h.ok(A, "stats")["admission_waits"] == 1
    assert not [r for _, r, _ in h.replies if r["rid"] == rid]
    h.ok(A, "kv_free", cap=kv_a)
    h.drain()
    assert h.reply(B, rid)["ok"] is True
    h.clean()


def test_a_call_that_waited_past_admit_wait_fails_with_enospc_and_changes_nothing():
    h = Harness(kv_pages=5, page_size=4, memory=MemoryConfig(admit_wait_s=0.05))
    kv_a = cache(h, A, doc(0))                               # 4 pages
    kv_b = cache(h, B, [1])                                  # the fifth
    before = h.entries(kv_b)
    rid = h.send(B, "pred", cap=kv_b, tokens=list(range(1, 9)))
    assert not h.engine.step()
    time.sleep(0.06)
    h.drain()
    assert h.reply(B, rid)["error"]["code"] == "ENOSPC"
    assert h.entries(kv_b) == before and h.engine.scheduler.pending() == 0
    assert h.ok(A, "kv_stat", cap=kv_a)["tokens"] == DOC
    h.clean()


def test_two_generates_that_cannot_both_finish_run_one_after_the_other(tmp_path):
    """Each needs 3 pages to finish; the device has 4. Admitting both would leave each
    holding part of the pool and waiting for the rest: the second waits instead, and
    runs once the first is done (its cache moving to the host to make room)."""
    h = Harness(kv_pages=4, page_size=4,
                memory=MemoryConfig(host_pages=8, swap_dir=str(tmp_path)))
    want = Harness(kv_pages=64, page_size=4)
    a, b = h.ok(A, "kv_create")["cap"], h.ok(B, "kv_create")["cap"]
    ga = h.send(A, "generate", cap=a, tokens=[1, 2, 3], max_tokens=9, stop=[], stream=False)
    gb = h.send(B, "generate", cap=b, tokens=[4, 5, 6], max_tokens=9, stop=[], stream=False)
    h.drain()
    for who, cap, rid, prompt in ((A, a, ga, [1, 2, 3]), (B, b, gb, [4, 5, 6])):
        reply = h.reply(who, rid)
        assert reply["finish_reason"] == "length" and reply["generated"] == 9
        ref = want.ok(who, "kv_create")["cap"]
        assert reply["tokens"] == want.ok(who, "generate", cap=ref, tokens=prompt,
                                          max_tokens=9, stop=[], stream=False)["tokens"]
    assert h.ok(A, "stats")["admission_waits"] == 1 and h.engine.pool.held == 0
    assert tiers_of(h, a) == [HOST] * 3 and tiers_of(h, b) == [DEVICE] * 3
    h.clean()


@pytest.mark.parametrize("host,disk", [(0, 0), (16, 0), (0, 16)])
def test_info_reports_the_tiers(tmp_path, host, disk):
    h = tiered(tmp_path, host=host, disk=disk)
    info = h.ok(A, "info")
    assert (info["pages_total"], info["host_pages"], info["disk_pages"]) == (8, host, disk)
    h.clean()


def test_off_device_names_a_cache_s_lower_tier_pages_once_in_order(tmp_path):
    h = tiered(tmp_path)
    memory, store = h.engine.memory, h.engine.store
    kv = cache(h, A, doc(1))
    obj = store.get(h.engine.caps.lookup(kv).oid)
    assert memory.off_device(obj) == []                    # nothing below the device
    h.ok(A, "kv_policy", cap=kv, evict=True)
    assert memory.off_device(obj) == obj.pages             # all 4, in the cache's order
    other = store.get(h.engine.caps.lookup(cache(h, B, doc(2))).oid)
    assert memory.off_device(other) == []                  # the tiers hold another's
    twice = type(obj)(oid=-1, pages=obj.pages[:2] * 2)
    assert memory.off_device(twice) == obj.pages[:2]       # a page once
    h.clean()
