"""The GPU half of two-level scheduling: pending calls in, a batch plan out.

Pure bookkeeping — no tensors, no sockets. A call (predd/engine/calls.py; the scheduler reads
only its scheduling fields) has tokens `computed` and tokens `total`; every step lets
`computed` catch up by at most the step's token budget (prefill, chunked prefill and
decode are the same thing). Rules:
* Calls on one KV object run one at a time, in arrival order.
* A step takes at most `max_batch` calls and `token_budget` tokens, in a fair order:
  round robin across uids first, then across the sessions of each uid (a uid with 100
  sessions gets one share, not 100); within a uid short calls (decodes) go before
  longer ones. The rotation moves every step, so over budget everyone gets a turn.
* Latency bound: when more than one uid has work (queued, or a call finished in the
  last `active_s` seconds), a step may take at most `latency_factor` times as long
  as the smallest of those uids' work would alone, predicted from measured step times
  (`StepCost`). What the prediction misses (per-call and context costs, a busy host)
  is corrected by feedback: a bounded step that took longer than its bound shrinks the
  next bounds (x0.8), one within it lets them grow back (x1.1). A flood of long prompts
  from one uid then slows another uid's decode by about that factor, at the cost of
  the flooder's throughput.
* Adaptive launch: after a step, the objects whose calls finished in it are *expected*
  to send their next call. The next step waits for them as long as
  predd/engine/return_times.py's hold (0.3 of the step, or until 9 in 10 of them are due by their
  learned return times; at most a step and `max_wait_s`); with nothing expected, or a
  full batch already waiting, it launches at once — unless an expected object belongs
  to a uid with nothing queued: a pred loop is not left behind another uid's flood.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from predd.engine.calls import Call
from predd.engine.return_times import ReturnTimes
from predd.server.quotas import add_count


@dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 2048   # as vLLM's max_num_batched_tokens default
    max_batch: int = 64
    wait_factor: float = 0.3
    max_wait_s: float = 0.02
    latency_factor: float = 2.0   # 0: no latency bound across uids
    active_s: float = 0.5         # a uid counts as waiting this long after a call came or ended


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


class StepCost:
    """How long a step of n tokens takes, learned from the steps run: per power-of-two
    size class a mean size and a time, read as a non-decreasing piecewise-linear curve,
    extrapolated past the ends. The time follows a faster step at once and a slower one
    only by `rise` of the difference: noise on a shared host (other processes, page
    faults) only ever slows a step, so the curve tracks the uncontended cost, and the
    bound compares like with like."""

    def __init__(self, rise: float = 0.05) -> None:
        self.rise = rise
        self._classes: dict[int, list[float]] = {}   # n.bit_length() -> [tokens, seconds]

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or seconds <= 0:
            return
        point = self._classes.get(tokens.bit_length())
        if point is None:
            self._classes[tokens.bit_length()] = [float(tokens), seconds]
            return
        point[0] += 0.25 * (tokens - point[0])
        point[1] = seconds if seconds < point[1] else point[1] + self.rise * (seconds - point[1])

    def _curve(self) -> list[tuple[float, float]]:
        curve, top = [], 0.0
        for k in sorted(self._classes):
            tokens, seconds = self._classes[k]
            top = max(top, seconds)
            curve.append((tokens, top))
        return curve

    def predict(self, tokens: int) -> float | None:
        """Seconds for a step of `tokens`; None until two size classes were seen."""
        curve = self._curve()
        if len(curve) < 2:
            return None
        i = 1
        while i < len(curve) - 1 and curve[i][0] < tokens:
            i += 1
        (x0, y0), (x1, y1) = curve[i - 1], curve[i]
        slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        return max(y0 + slope * (tokens - x0), 0.0)

    def tokens_within(self, seconds: float, most: int) -> int:
        """The largest step (1..most tokens) predicted to take at most `seconds`."""
        lo, hi = 1, most
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (self.predict(mid) or 0.0) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _rotated(keys: list[int], turn: int) -> list[int]:
    k = turn % len(keys) if keys else 0
    return keys[k:] + keys[:k]


def _interleave(lists: list[list[Call]]) -> list[Call]:
    """The first of each list, then the second of each, ..."""
    out: list[Call] = []
    for i in range(max((len(x) for x in lists), default=0)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


class Scheduler:
    def __init__(self, config: SchedulerConfig,
                 on_leave: Callable[[Call], None] = lambda call: None) -> None:
        self.config = config
        self.on_leave = on_leave                   # every call that leaves the queue
        self._queues: dict[int, list[Call]] = {}   # oid -> calls in arrival order
        self._ids = itertools.count(1)
        self._rotation = 0
        self._pending = 0
        self._of_session: dict[int, int] = {}      # queued calls per session and uid
        self._of_uid: dict[int, int] = {}
        self.expected: set[int] = set()            # oids whose next call we wait for
        self._expected_uid: dict[int, int] = {}    # their uids
        self.last_step_end = 0.0
        self.waited_s = 0.0                        # total adaptive-launch waiting
        self.returns = ReturnTimes()               # when expected objects come back
        self.cost = StepCost()
        self.steps = 0
        self._active: dict[int, tuple[float, int]] = {}   # uid -> (time, tokens) of its last call
        self.capped_steps = 0                      # steps the latency bound made smaller
        self._scale = 1.0                          # feedback on the predicted bound
        self._bound_s: float | None = None         # the bound of the step being planned

    # ------------------------------------------------------------ queue

    def submit(self, call: Call, now: float) -> Call:
        call.cid = next(self._ids)
        call.arrival = now
        self._queues.setdefault(call.oid, []).append(call)
        if call.oid in self.expected:
            self.returns.came(call.oid, max(now - self.last_step_end, 0.0))
            self.expected.discard(call.oid)
        self._count(call, 1)
        self._active[call.uid] = (now, min(call.total, self.config.token_budget))
        return call

    def _count(self, call: Call, n: int) -> None:
        self._pending += n
        add_count(self._of_session, call.session, n)
        add_count(self._of_uid, call.uid, n)

    def busy(self, oid: int) -> bool:
        return oid in self._queues

    def calls_on(self, oid: int) -> list[Call]:
        """The calls queued on `oid`, in arrival order (empty: none)."""
        return self._queues.get(oid, [])

    def admitted(self, oid: int) -> bool:
        """Whether a call on `oid` is admitted (holds its memory) and not done."""
        queue = self._queues.get(oid)
        return bool(queue) and queue[0].admitted

    def pending(self) -> int:
        return self._pending

    def all_calls(self) -> list[Call]:
        return [c for q in self._queues.values() for c in q]

    def queued(self, session: int | None = None, uid: int | None = None) -> int:
        """Calls queued for a session or a uid (O(1))."""
        if session is not None:
            return self._of_session.get(session, 0)
        return self._of_uid.get(uid, 0)

    def remove(self, call: Call) -> None:
        queue = self._queues.get(call.oid, [])
        if call in queue:
            queue.remove(call)
            self._count(call, -1)
            self.on_leave(call)
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
        self.returns.forget(oid)

    # ------------------------------------------------------------ planning

    def _heads(self) -> list[Call]:
        return [q[0] for q in self._queues.values() if q[0].remaining > 0]

    def _eligible(self) -> list[Call]:
        """Runnable calls in fair order: uids in rotation, each uid's calls
        interleaved across its sessions (also in rotation), decodes first."""
        by_uid: dict[int, dict[int, list[Call]]] = {}
        for call in sorted(self._heads(), key=lambda c: (c.remaining > 1, c.cid)):
            by_uid.setdefault(call.uid, {}).setdefault(call.session, []).append(call)
        per_uid = []
        for uid in _rotated(sorted(by_uid), self._rotation):
            sessions = by_uid[uid]
            order = _rotated(sorted(sessions), self._rotation)
            short = _interleave([[c for c in sessions[s] if c.remaining == 1] for s in order])
            long = _interleave([[c for c in sessions[s] if c.remaining > 1] for s in order])
            per_uid.append(short + long)
        return _interleave(per_uid)

    def latency_cap(self, heads: list[Call]) -> int:
        """The most tokens the next step may take under the latency bound."""
        budget = self.config.token_budget
        if not self.config.latency_factor:
            return budget
        demand: dict[int, int] = {}
        for call in heads:
            demand[call.uid] = demand.get(call.uid, 0) + call.remaining
        for uid, (_, tokens) in self._active.items():
            demand.setdefault(uid, tokens)
        self._bound_s = None
        if len(demand) < 2:
            return budget
        least = min(min(demand.values()), budget)
        alone = self.cost.predict(least)
        if alone is None:
            return budget
        self._bound_s = self.config.latency_factor * alone
        cap = int(self.cost.tokens_within(self._bound_s, budget) * self._scale)
        return min(max(cap, len(demand) * least), budget)   # room for each uid's least

    def wait_time(self, now: float) -> float | None:
        """Seconds to hold the next launch; None when there is nothing to run."""
        heads = self._heads()
        if not heads:
            return None
        if not self.expected:
            return 0.0
        full = (len(heads) >= self.config.max_batch
                or sum(c.remaining for c in heads) >= self.config.token_budget)
        if full and {self._expected_uid.get(o) for o in self.expected} <= {c.uid for c in heads}:
            return 0.0
        return max(0.0, self.last_step_end + self.returns.hold_s - now)

    def schedule(self, admit: Callable[[Call], bool | None] = lambda call: True) -> Plan:
        """The next step's batch. `admit` is asked before a call's first chunk (the
        engine reserves memory there): True admits it, False refuses it (it leaves the
        queue), None leaves it queued for a later step (no room yet: it is asked again
        each step, in the fair order, so waiting calls are served fairly).

        Two passes over the fair order: first every uid may take up to an equal share
        of the budget, then what is left goes to whoever can use it."""
        eligible = self._eligible()
        budget = self.latency_cap(eligible)
        if budget < self.config.token_budget and \
                sum(c.remaining for c in eligible) > budget:
            self.capped_steps += 1
        share = max(budget // max(len({c.uid for c in eligible}), 1), 1)
        counts: dict[int, int] = {}          # cid -> tokens this step
        taken: dict[int, int] = {}           # uid -> tokens this step
        refused: set[int] = set()
        for fair in (True, False):
            for call in eligible:
                if budget == 0:
                    break
                have = counts.get(call.cid, 0)
                room = share - taken.get(call.uid, 0) if fair else budget
                count = min(call.remaining - have, room, budget)
                if count <= 0 or call.cid in refused or (
                        not have and len(counts) == self.config.max_batch):
                    continue
                if not call.admitted:
                    verdict = admit(call)
                    if not verdict:
                        if verdict is not None:
                            self.remove(call)
                        refused.add(call.cid)
                        continue
                    call.admitted = True
                counts[call.cid] = have + count
                taken[call.uid] = taken.get(call.uid, 0) + count
                budget -= count
        self._rotation += 1
        return Plan([PlanItem(c, c.computed, counts[c.cid]) for c in eligible
                     if c.cid in counts])

    def update(self, plan: Plan, finished: set[int], now: float, step_time: float) -> None:
        """Record a step's outcome. The engine has already grown the `total` of generate
        calls that go on; `finished` holds the cids that are complete."""
        self.last_step_end = now
        self.cost.observe(plan.num_tokens, step_time)
        if self._bound_s is not None and plan.items:
            if step_time > 1.05 * self._bound_s:
                self._scale = max(self._scale * 0.8, 1 / 1024)
            else:
                self._scale = min(self._scale * 1.1, 1.0)
        self.steps += 1
        for oid in self.expected:        # not back before this step ended
            self.returns.missed(oid)
        self.expected = set()
        self._expected_uid = {}
        for item in plan.items:
            call = item.call
            call.computed = item.start + item.count
            if call.cid in finished:
                self.remove(call)
                self._active[call.uid] = (now, 1 if call.generating else
                                          min(call.total, self.config.token_budget))
                if not call.generating:
                    self.expected.add(call.oid)
                    self._expected_uid[call.oid] = call.uid
        horizon = now - self.config.active_s
        for uid in [u for u, (seen, _) in self._active.items() if seen < horizon]:
            del self._active[uid]
        # An object with a queued call is not waited for.
        self.expected -= set(self._queues)
        self.returns.plan(self.expected, step_time, self.config.wait_factor,
                          self.config.max_wait_s)

    def note_wait(self, seconds: float) -> None:
        self.waited_s += seconds

    def check(self) -> list[str]:
        """Problems found recounting the queued-call counters."""
        of_session: dict[int, int] = {}
        of_uid: dict[int, int] = {}
        calls = [c for q in self._queues.values() for c in q]
        for call in calls:
            of_session[call.session] = of_session.get(call.session, 0) + 1
            of_uid[call.uid] = of_uid.get(call.uid, 0) + 1
        if (len(calls), of_session, of_uid) != (self._pending, self._of_session, self._of_uid):
            return [f"scheduler counts {self._pending} calls {self._of_session} per session, "
                    f"{self._of_uid} per uid; queues hold {len(calls)}, {of_session}, {of_uid}"]
        return []
