"""Memory tiers with the real model: a predd whose device pool holds a quarter of the
caches a program keeps, with host and disk tiers below it (predd/memory/policy.py).

Caches of 250 entries take 16 pages; the device pool has 32."""
from __future__ import annotations

import numpy as np
import pytest

import liblip
from tests.conftest import start_predd

DOC = 250
DOCS = 8      # 8 x 16 pages = 4x the device pool


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    rundir = str(tmp_path_factory.mktemp("tiers"))
    daemon = start_predd(rundir, "--kv-pages", "32", "--host-pages", "48",
                         "--disk-pages", "96", "--max-step-tokens", "256", "--lease", "5")
    liblip.connect(daemon.addr)
    yield liblip
    report = liblip.fsck()
    code = daemon.stop()
    assert report["clean"], report["problems"]
    assert code == 0


def doc(i: int) -> list[int]:
    rng = np.random.default_rng(i)
    return rng.integers(100, 40000, DOC).tolist()


def greedy(lip, kv, n: int = 4) -> list[int]:
    return lip.generate(kv, [42], max_tokens=n, stop=[])


def test_caches_four_times_the_device_pool_keep_their_tokens(small):
    lip = small
    want = []
    for i in range(DOCS):                  # each alone: nothing moves
        kv = lip.kv_create()
        lip.prefill(kv, doc(i))
        probe = lip.kv_fork(kv)
        want.append(greedy(lip, probe))
        lip.kv_close(probe)
        lip.kv_close(kv)
    before = lip.stats()
    caches = []
    for i in range(DOCS):                  # all kept: 128 pages on 32
        kv = lip.kv_create()
        lip.prefill(kv, doc(i))
        caches.append(kv)
    tiers = {lip.kv_stat(kv)["tier"] for kv in caches}
    assert tiers == {"device", "host", "disk"}
    got = []
    for kv in caches:
        probe = lip.kv_fork(kv)
        got.append(greedy(lip, probe))
        lip.kv_close(probe)
    assert got == want
    after = lip.stats()
    assert after["pages_moved_down"] - before["pages_moved_down"] >= 96
    assert after["pages_moved_up"] - before["pages_moved_up"] >= 96
    assert after["tiers"]["device"]["pages_total"] == 32
    used = sum(t["pages_used"] for t in after["tiers"].values())
    assert used == DOCS * 16
    for kv in caches:
        lip.kv_close(kv)


def test_evict_then_pred_gives_bit_exact_logits_and_reports_the_swap(small):
    lip = small
    kv = lip.kv_create()
    lip.prefill(kv, doc(11))
    probe = lip.kv_fork(kv)
    first = lip.pred(probe, [7, 8])
    lip.kv_close(probe)
    stat = lip.kv_policy(kv, evict=True)
    assert (stat["tier"], stat["tokens"]) == ("host", DOC)
    probe = lip.kv_fork(kv)
    again = lip.pred(probe, [7, 8])
    assert np.array_equal(again.logits, first.logits)
    cost = again.cost
    assert cost["swapped_in"] == DOC and cost["swap_ms"] > 0
    assert lip.kv_stat(kv)["tier"] == "device"
    lip.kv_close(probe)
    lip.kv_close(kv)


def test_a_pinned_cache_stays_on_the_device_under_pressure(small):
    lip = small
    hot = lip.kv_create()
    lip.prefill(hot, doc(20)[:120])         # 8 pages: the pin quota, a quarter of 32
    assert lip.kv_policy(hot, pin=True)["pinned"] is True
    others = []
    for i in range(3):                      # 48 more pages through the 24 left
        kv = lip.kv_create()
        lip.prefill(kv, doc(21 + i))
        others.append(kv)
    assert lip.kv_stat(hot)["tier"] == "device"
    with pytest.raises(liblip.LipError) as err:
        lip.kv_policy(hot, evict=True)
    assert err.value.code == "EBUSY"
    with pytest.raises(liblip.LipError) as err:   # 8 pinned + 16 > 8, a quarter
        lip.kv_policy(others[-1], pin=True)
    assert err.value.code == "EDQUOT"
    lip.kv_policy(hot, pin=False)
    for kv in [hot, *others]:
        lip.kv_close(kv)


def test_io_wait_marks_a_programs_caches_first_to_move(small):
    lip = small
    old = lip.kv_create()
    lip.prefill(old, doc(30))              # 16 pages, least recently used
    waiting = lip.kv_create()
    lip.prefill(waiting, doc(31))          # 16 more: the device is full
    with lip.io_wait(waiting):
        fresh = lip.kv_create()            # needs 16: the waiting cache goes, not the old
        lip.prefill(fresh, doc(32))
        assert lip.kv_stat(waiting)["tier"] != "device"
        assert lip.kv_stat(old)["tier"] == "device"
    for kv in (old, waiting, fresh):
        lip.kv_close(kv)
