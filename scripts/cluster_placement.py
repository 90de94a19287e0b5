"""Where a run goes: round-robin, least loaded, or cache affinity under a load cap.

A policy's `place(run, replicas, costs)` returns a Placement: the replica, and for cache
affinity possibly a replica to copy the run's cache from. `in_flight` (runs routed to a
replica and not finished) is the load every policy sees. Cache affinity follows the
issue's contract: a run goes to the replica holding the longest prefix of what it names
(SGLang's cache-aware router), unless that replica is above LOAD_CAP x the mean runs in
flight; without a match, to the least loaded.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scripts.cluster_sim import Costs, Replica, Run

LOAD_CAP = 1.5          # no replica above this many times the mean runs in flight


@dataclass(frozen=True)
class Placement:
    replica: int
    migrate_from: int | None = None


def under_cap(replicas: list[Replica]) -> list[Replica]:
    """Those not above LOAD_CAP times the mean runs in flight (counted before the new
    run); never empty: the least loaded is at most the mean."""
    cap = LOAD_CAP * sum(x.in_flight for x in replicas) / len(replicas)
    return [x for x in replicas if x.in_flight <= cap]


def least_loaded(replicas: list[Replica]) -> Replica:
    return min(replicas, key=lambda x: (x.in_flight, x.index))


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self.next = 0

    def place(self, run: Run, replicas: list[Replica], costs: Costs) -> Placement:
        i = self.next % len(replicas)
        self.next += 1
        return Placement(i)


class LeastLoaded:
    name = "least-loaded"

    def place(self, run: Run, replicas: list[Replica], costs: Costs) -> Placement:
        return Placement(least_loaded(replicas).index)


class CacheAffinity:
    """The longest matching prefix among replicas under the cap (ties: least loaded);
    no match: least loaded. When the longest prefix anywhere is on a replica over the
    cap, copy it to the chosen one if that beats recomputing it."""
    name = "cache-affinity"

    def place(self, run: Run, replicas: list[Replica], costs: Costs) -> Placement:
        match = [min(x.cache.held(run.key), run.prefix) for x in replicas]
        best = max(under_cap(replicas), key=lambda x: (match[x.index], -x.in_flight, -x.index))
        if match[best.index] == 0:
            best = least_loaded(replicas)
        source = max(range(len(replicas)), key=lambda i: (match[i], -i))
        have, gain = match[best.index], match[source] - match[best.index]
        if gain > 0 and costs.migrate_time(match[source]) < costs.prefill_time(gain, have):
            return Placement(best.index, source)
        return Placement(best.index)


POLICIES: dict[str, Callable[[], RoundRobin | LeastLoaded | CacheAffinity]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, CacheAffinity)}
