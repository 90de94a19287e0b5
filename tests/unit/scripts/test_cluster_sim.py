"""The cluster simulation's core (scripts/cluster_sim.py, cluster_placement.py) on tiny
deterministic cases: placement order, the load cap, LRU eviction, the step model, hits.

Costs are whole seconds per step (or exact binary fractions), so times compare exactly.
"""
from __future__ import annotations

import sys

import pytest

from scripts.cluster_placement import CacheAffinity, LeastLoaded, Placement, RoundRobin
from scripts.cluster_sim import Cache, Cluster, Costs, Replica, ReplicaConfig, Run
from scripts.cluster_workload import Agent, Rag

STEP = Costs(step_s=1.0, prefill_s_per_token=0.0, prefill_attend_s=0.0,
             decode_s_per_call=0.0, attend_s_per_token=0.0,
             migrate_bytes_per_s=1024.0, kv_bytes_per_token=16)


def run(key: str | None, prefix: int = 4, question: int = 1, answer: int = 1,
        keep: int | None = None, last: bool = False) -> Run:
    return Run(0, 0, key, prefix, prefix + question, answer,
               keep=prefix if keep is None else keep, last=last)


class Script:
    """One client's runs, in order, each sent as soon as the last is answered."""
    name = "script"

    def __init__(self, runs: list[Run]) -> None:
        self.runs = list(runs)

    def next(self, client: int, done: Run | None) -> tuple[float, Run]:
        return 0.0, self.runs.pop(0) if self.runs else run("idle")


def replicas(*loads: int, config: ReplicaConfig = ReplicaConfig()) -> list[Replica]:
    out = [Replica(i, config) for i in range(len(loads))]
    for r, load in zip(out, loads):
        r.in_flight = load
    return out


# ------------------------------------------------------------------ placement

def test_round_robin_cycles_in_order():
    rs, policy = replicas(0, 0, 0), RoundRobin()
    assert [policy.place(run("d"), rs, STEP).replica for _ in range(7)] == \
        [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_takes_the_lowest_index_on_ties():
    assert LeastLoaded().place(run("d"), replicas(2, 1, 1), STEP) == Placement(1)


def test_affinity_stays_at_exactly_the_cap():
    rs = replicas(3, 1)                 # mean 2, cap 3: replica 0 is not above it
    rs[0].cache.put("d", 4)
    assert CacheAffinity().place(run("d"), rs, STEP) == Placement(0)


def test_affinity_diverts_above_the_cap_and_copies_the_cache():
    rs = replicas(4, 1)                 # mean 2.5, cap 3.75: replica 0 is above it
    rs[0].cache.put("d", 4)
    # copying 4 tokens x 16 bytes at 1024 B/s (1/16 s) beats computing them (1 s a token)
    costs = Costs(**{**STEP.__dict__, "prefill_s_per_token": 1.0})
    assert CacheAffinity().place(run("d"), rs, costs) == Placement(1, migrate_from=0)


def test_affinity_recomputes_when_copying_is_slower():
    rs = replicas(4, 1)
    rs[0].cache.put("d", 4)
    assert CacheAffinity().place(run("d"), rs, STEP) == Placement(1)   # prefill is free


def test_affinity_prefers_the_longest_prefix_under_the_cap():
    rs = replicas(1, 1, 1)
    rs[1].cache.put("s", 6)
    rs[2].cache.put("s", 9)
    assert CacheAffinity().place(run("s", prefix=9), rs, STEP) == Placement(2)


def test_affinity_without_a_match_is_least_loaded():
    rs = replicas(2, 0, 1)
    rs[0].cache.put("other", 4)
    assert CacheAffinity().place(run("d"), rs, STEP) == Placement(1)


# ------------------------------------------------------------------ cache

def test_lru_evicts_exactly_the_oldest_unused_entry():
    c = Cache(10)
    for key in "abc":
        assert c.put(key, 3)
    c.pin("a")                          # a use makes it the most recent
    c.unpin("a")
    assert c.put("d", 3)
    assert c.evicted == ["b"]
    assert list(c.entries) == ["c", "a", "d"]


def test_an_entry_in_use_is_never_evicted():
    c = Cache(10)
    c.put("a", 6)
    c.put("b", 3)
    c.pin("a")
    assert not c.put("c", 5)            # only b (3) could go: not enough, nothing goes
    assert c.evicted == [] and list(c.entries) == ["b", "a"]
    assert c.put("c", 4)
    assert c.evicted == ["b"]


def test_step_chunks_prefill_under_the_token_budget():
    r = Replica(0, ReplicaConfig(kv_tokens=100, max_step_tokens=8))
    a, b = run(None, prefix=0, question=6), run(None, prefix=0, question=6)
    a.id, b.id = 1, 2
    r.queue += [a, b]
    r.admit()
    costs = Costs(1.0, 0.5, 0.25, 0.0, 0.0, 1.0, 1)
    # 8 tokens: a's 6 (pairs 6 x 3) and b's first 2 (pairs 2 x 1)
    assert r.plan(costs) == 1.0 + 0.5 * 8 + 0.25 * 20
    assert r.advance() == [a]           # a's prefill ended: its one token, done
    assert (b.computed, b.decoded) == (2, 0)


# ------------------------------------------------------------------ whole runs

def test_hits_misses_and_eviction_on_one_replica():
    # 9 tokens: one 4-token document and one running 6-token run do not fit together
    script = Script([run("A"), run("A"), run("B"), run("A")])
    cluster = Cluster(1, LeastLoaded(), script, 1, STEP, ReplicaConfig(kv_tokens=9))
    res = cluster.run(requests=4, warmup=0)
    assert (res.runs, res.hits, res.named) == (4, 1, 4)
    assert res.latencies == [1.0, 1.0, 1.0, 1.0] and res.seconds == 4.0
    assert cluster.replicas[0].cache.evicted == ["A", "B"]


def test_the_measurement_starts_after_the_warm_up():
    script = Script([run("A", answer=2), run("A", answer=3), run("A", answer=1)])
    res = Cluster(1, RoundRobin(), script, 1, STEP).run(requests=3, warmup=1)
    assert (res.runs, res.hits, res.seconds, res.latencies) == (2, 2, 4.0, [3.0, 1.0])


def test_a_migration_is_waited_for_counted_and_hits():
    cluster = Cluster(2, CacheAffinity(), Script([]), 0,
                      Costs(**{**STEP.__dict__, "prefill_s_per_token": 1.0}))
    r0, r1 = cluster.replicas
    r0.cache.put("d", 4)
    r0.in_flight, r1.in_flight = 4, 1
    x = run("d")
    cluster.issue(0.0, x)
    assert (x.replica, x.migrated) == (1, 64)
    t, _, _, what = cluster.heap[0]
    assert t == 64 / 1024
    cluster.arrive(t, what)
    assert r1.cache.entries == {"d": 4} and r1.running == [x]
    assert x.reused == 4 and x.hit


def test_a_session_grows_its_cache_and_drops_it_at_the_end():
    turns = [run("s", prefix=0, question=5, answer=2, keep=7),
             run("s", prefix=7, question=2, answer=1, keep=10, last=True)]
    cluster = Cluster(1, CacheAffinity(), Script(turns), 1, STEP)
    res = cluster.run(requests=2, warmup=0)
    assert (res.hits, res.named) == (1, 1)   # the first turn names nothing that exists
    assert turns[1].reused == 7
    assert cluster.replicas[0].cache.entries == {}


def test_zipf_ranks_are_seeded_and_skewed():
    a, b = Rag(alpha=2.0, docs=8, seed=3), Rag(alpha=2.0, docs=8, seed=3)
    picks = [a.pick() for _ in range(200)]
    assert picks == [b.pick() for _ in range(200)]
    assert set(picks) <= set(range(1, 9)) and picks.count(1) > picks.count(2) > 0


def test_agent_turns_extend_the_last_context():
    w = Agent(seed=1)
    gap, first = w.next(0, None)
    assert gap == 0.0 and first.prefix == 0 and first.prompt >= w.system_tokens
    _, second = w.next(0, first)
    assert second.key == first.key and second.prefix == first.keep
    assert second.prompt > second.prefix


def test_a_run_larger_than_a_replica_is_refused():
    r = Replica(0, ReplicaConfig(kv_tokens=5))
    r.queue.append(run(None, prefix=0, question=5, answer=1))
    with pytest.raises(ValueError):
        r.admit()


def test_the_report_without_matplotlib(monkeypatch, tmp_path, capsys):
    from scripts import simulate_cluster
    script = Script([run("A"), run("A")])
    res = Cluster(1, RoundRobin(), script, 1, STEP).run(requests=2, warmup=0)
    assert simulate_cluster.table([res]).splitlines()[2] == \
        "| script | 1 | round-robin | 1.00 | 1.0 | 0.500 | 1.00 | 1.00 | 1.00 | 0 | 0.00 |"
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import fails
    assert simulate_cluster.plot([res], str(tmp_path / "x.png")) is False
    assert not (tmp_path / "x.png").exists()
    assert "matplotlib is not installed" in capsys.readouterr().err
