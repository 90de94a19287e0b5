"""Where a run or an OpenAI request goes, among the replicas (pure: no I/O).

The rule (docs/serving.md, "Replicas"), for runs and requests alike:
* candidates: the live replicas whose work in flight is not above LOAD_CAP times the
  mean over the live replicas, counted before the new work (so no replica takes more
  than its share while affinity pulls everything towards it);
* among them the one with the most affinity (a run: tokens its `near` files hold there;
  a request: the longest prefix of its prompt an earlier prompt there shared);
* no affinity anywhere, or a tie: the least loaded, then the lowest index.

`loads[i]` is None for a replica that is not a candidate at all (down, or remote while
a local one is up).
"""
from __future__ import annotations

from collections.abc import Sequence

LOAD_CAP = 1.5


def under_cap(loads: Sequence[int | None], cap: float = LOAD_CAP) -> list[int]:
    """The indices of the live replicas whose load is not above `cap` x the mean."""
    live = [i for i, load in enumerate(loads) if load is not None]
    if not live:
        return []
    total = sum(loads[i] for i in live)
    # load <= cap * total / n, multiplied out: no rounding at the boundary
    return [i for i in live if loads[i] * len(live) <= cap * total]


def choose(loads: Sequence[int | None], affinity: Sequence[int],
           cap: float = LOAD_CAP) -> int | None:
    """The replica for new work: see the module's rule. None when no replica is live."""
    candidates = under_cap(loads, cap)
    if not candidates:
        return None
    best = max(affinity[i] for i in candidates)
    if best > 0:
        candidates = [i for i in candidates if affinity[i] == best]
    return min(candidates, key=lambda i: (loads[i], i))
