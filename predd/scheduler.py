"""The GPU half of two-level scheduling: pending calls in, a batch plan out.

Pure bookkeeping — no tensors, no sockets. A call has tokens `computed` and tokens
`total`; every step lets `computed` catch up by at most the step's token budget
(prefill, chunked prefill and decode are the same thing). Rules:
* Calls on one KV object run one at a time, in arrival order.
* A step takes at most `max_batch` calls and `token_budget` tokens. Short calls
  (decodes) go first, then longer ones; ties rotate across sessions, so when over
  budget every session gets its turn (round robin).
* Adaptive launch: after a step, the objects whose calls finished in it are *expected*
  to send their next call. The next step waits for them, but no longer than
  `wait_factor * last step time` (capped at `max_wait_s`); with nothing expected, or a
  full batch already waiting, it launches at once.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 2048   # as vLLM's max_num_batched_tokens default
    max_batch: int = 64
    wait_factor: float = 0.3
    max_wait_s: float = 0.02


@dataclass
class Call:
    session: int
    oid: int
    total: int                 # tokens to compute so far (a generate grows it by one a step)
    computed: int = 0
    generating: bool = False   # stays queued after catching up, until the engine ends it
    payload: Any = None        # the engine's own state for this call
    cid: int = 0
    arrival: float = 0.0
    admitted: bool = False

    @property
    def remaining(self) -> int:
        return self.total - self.computed


@dataclass
class PlanItem:
    call: Call
    start: int   # first token index of this chunk within the call
    count: int

    @property
    def completes(self) -> bool:
        """Whether the call's known tokens are all computed after this chunk."""
        return self.start + self.count == self.call.total


@dataclass
class Plan:
    items: list[PlanItem] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(item.count for item in self.items)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._queues: dict[int, list[Call]] = {}   # oid -> calls in arrival order
        self._ids = itertools.count(1)
        self._rotation = 0
        self.expected: set[int] = set()            # oids whose next call we wait for
        self.last_step_end = 0.0
        self.last_step_time = 0.0
        self.waited_s = 0.0                        # total adaptive-launch waiting

    # ------------------------------------------------------------ queue

    def submit(self, call: Call, now: float) -> Call:
        call.cid = next(self._ids)
        call.arrival = now
        self._queues.setdefault(call.oid, []).append(call)
        self.expected.discard(call.oid)
        return call

    def busy(self, oid: int) -> bool:
        return oid in self._queues

    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def remove(self, call: Call) -> None:
        queue = self._queues.get(call.oid, [])
        if call in queue:
            queue.remove(call)
        if not queue:
            self._queues.pop(call.oid, None)

    def cancel(self, predicate: Callable[[Call], bool]) -> list[Call]:
        """Drop every queued call matching `predicate` (a session ended, an object freed)."""
        dropped = [c for q in self._queues.values() for c in q if predicate(c)]
        for call in dropped:
            self.remove(call)
        self.expected -= {c.oid for c in dropped}
        return dropped

    def forget(self, oid: int) -> None:
        self.expected.discard(oid)

    # ------------------------------------------------------------ planning

    def _eligible(self) -> list[Call]:
        heads = [q[0] for q in self._queues.values() if q[0].remaining > 0]
        sessions = sorted({c.session for c in heads})
        rank = {s: (i - self._rotation) % len(sessions) for i, s in enumerate(sessions)}
        return sorted(heads, key=lambda c: (c.remaining > 1, rank[c.session], c.cid))

    def wait_time(self, now: float) -> float | None:
        """Seconds to hold the next launch; None when there is nothing to run."""
        heads = self._eligible()
        if not heads:
            return None
        if not self.expected:
            return 0.0
        if (len(heads) >= self.config.max_batch
                or sum(c.remaining for c in heads) >= self.config.token_budget):
            return 0.0
        hold = min(self.config.wait_factor * self.last_step_time, self.config.max_wait_s)
        return max(0.0, self.last_step_end + hold - now)

    def schedule(self, admit: Callable[[Call], bool] = lambda call: True) -> Plan:
        """The next step's batch. `admit` is asked once per call before its first chunk
        (the engine reserves memory there); a call it refuses leaves the queue."""
        plan = Plan()
        budget = self.config.token_budget
        for call in self._eligible():
            if len(plan.items) == self.config.max_batch or budget == 0:
                break
            if not call.admitted:
                if not admit(call):
                    self.remove(call)
                    continue
                call.admitted = True
            count = min(call.remaining, budget)
            plan.items.append(PlanItem(call, call.computed, count))
            budget -= count
        self._rotation += 1
        return plan

    def update(self, plan: Plan, finished: set[int], now: float, step_time: float) -> None:
        """Record a step's outcome. The engine has already grown the `total` of generate
        calls that go on; `finished` holds the cids that are complete."""
        self.last_step_end = now
        self.last_step_time = step_time
        self.expected = set()
        for item in plan.items:
            call = item.call
            call.computed = item.start + item.count
            if call.cid in finished:
                self.remove(call)
                if not call.generating:
                    self.expected.add(call.oid)
        # An object with a queued call is not waited for.
        self.expected -= set(self._queues)

    def note_wait(self, seconds: float) -> None:
        self.waited_s += seconds
