"""A discrete-event model of N predd replicas behind one placement policy.

What it owns: the event heap, the replicas (a FIFO queue, the running batch, an LRU
cache of named KV caches in tokens), the step model and the three placement policies.
The placement policies live in cluster_placement.py, the workloads (who sends what,
when) in cluster_workload.py, the CLI, calibration and report in simulate_cluster.py.

The model, in short (docs/scaling.md states it in full):
* A run names one cache (`key`: a document, a session) and the prefix of its prompt
  that cache holds. On the replica that runs it, `min(held, prefix)` tokens are reused
  and the rest of the prompt is computed; it is a *hit* when the whole prefix is reused.
* A replica holds `kv_tokens`: cached entries plus every running run's own tokens
  (prompt less reused, plus its answer). Admission is first come, first served, when
  those tokens fit after evicting least recently used entries that no run is using.
  A run's cache enters (or replaces) the replica's entry when the run finishes.
* A step is `Costs.step_time(prefill tokens, decoding calls, their context)`; predd's
  "let computed catch up": prefill is chunked under `max_step_tokens`, the step that
  ends a run's prefill also yields its first token.
* Migration: a placement may name a source replica; the run's cache is then copied
  from it (kv_export + kv_import at `migrate_bytes_per_s`) and the run waits for the
  copy, which takes no step time. The source keeps its copy until LRU drops it.
"""
from __future__ import annotations

import heapq
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

@dataclass(frozen=True)
class Costs:
    """A step's seconds and a migration's bytes, from --calibrate (docs/scaling_costs.json)."""
    step_s: float                  # a forward pass's fixed cost
    prefill_s_per_token: float
    prefill_attend_s: float        # per (prompt token, earlier token) pair it attends to
    decode_s_per_call: float
    attend_s_per_token: float      # per context token of each decoding call
    migrate_bytes_per_s: float     # kv_export + kv_import, end to end
    kv_bytes_per_token: int

    def step_time(self, prefill: int, pairs: float, decoding: int, context: int) -> float:
        return (self.step_s + self.prefill_s_per_token * prefill
                + self.prefill_attend_s * pairs
                + self.decode_s_per_call * decoding + self.attend_s_per_token * context)

    def prefill_time(self, tokens: int, start: int = 0) -> float:
        """The prefill part of computing tokens start..start+tokens."""
        return tokens * (self.prefill_s_per_token
                         + self.prefill_attend_s * (start + tokens / 2))

    def migrate_time(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.migrate_bytes_per_s

    @classmethod
    def load(cls, path: str) -> Costs:
        with open(path) as f:
            data = json.load(f)
        return cls(**{f.name: data[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class ReplicaConfig:
    kv_tokens: int = 16384
    max_batch: int = 64
    max_step_tokens: int = 2048


@dataclass
class Run:
    """One request, from its client's send to its last token."""
    id: int
    client: int
    key: str | None              # the cache it names; None: no hint
    prefix: int                  # prompt tokens that cache can supply
    prompt: int
    answer: int                  # tokens to decode
    keep: int                    # tokens the named cache holds after the run; 0: none
    issued: float = 0.0
    last: bool = False           # the session ends with it: its caches are dropped
    replica: int = -1
    reused: int = 0
    computed: int = 0            # prompt tokens computed so far (after `reused`)
    decoded: int = 0
    pinned: bool = False         # holds a reference on its replica's entry `key`
    migrated: int = 0            # bytes copied to its replica for it
    finished: float = math.nan

    @property
    def hit(self) -> bool:
        return self.prefix > 0 and self.reused >= self.prefix

    @property
    def own_tokens(self) -> int:
        """Pages it takes beyond a reused entry: the rest of its prompt, its answer."""
        return self.prompt - self.reused + self.answer


class Cache:
    """Named KV caches on one replica, LRU, in tokens; running runs' own tokens share
    the same capacity. An entry with references (runs using it) is never evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, int] = OrderedDict()   # oldest first
        self.refs: dict[str, int] = {}
        self.private = 0                                      # running runs' own tokens
        self.evicted: list[str] = []

    @property
    def used(self) -> int:
        return sum(self.entries.values()) + self.private

    def held(self, key: str | None) -> int:
        return self.entries.get(key, 0) if key is not None else 0

    def make_room(self, tokens: int) -> bool:
        """Evict unreferenced entries, oldest first, until `tokens` fit; False (and
        nothing evicted) when they cannot."""
        free = self.capacity - self.used
        if free >= tokens:
            return True
        idle = [k for k in self.entries if not self.refs.get(k)]
        if free + sum(self.entries[k] for k in idle) < tokens:
            return False
        for k in idle:
            if free >= tokens:
                break
            free += self.entries.pop(k)
            self.evicted.append(k)
        return True

    def pin(self, key: str) -> None:
        self.refs[key] = self.refs.get(key, 0) + 1
        self.entries.move_to_end(key)

    def unpin(self, key: str) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]

    def put(self, key: str, tokens: int) -> bool:
        """Hold `tokens` of `key` (replacing a shorter entry), most recent; False when
        they do not fit."""
        old = self.entries.pop(key, 0)
        if not self.make_room(tokens):
            if old:
                self.entries[key] = old
            return False
        self.entries[key] = tokens
        return True

    def drop(self, key: str) -> None:
        if not self.refs.get(key):
            self.entries.pop(key, None)


@dataclass
class Replica:
    index: int
    config: ReplicaConfig
    cache: Cache = field(init=False)
    queue: list[Run] = field(default_factory=list)
    running: list[Run] = field(default_factory=list)
    in_flight: int = 0           # routed here and not finished (migrating, queued, running)
    busy: bool = False
    chunk: dict[int, int] = field(default_factory=dict)      # run id -> prefill this step

    def __post_init__(self) -> None:
        self.cache = Cache(self.config.kv_tokens)

    def admit(self) -> None:
        """Queued runs into the batch, in order, while they fit."""
        while self.queue and len(self.running) < self.config.max_batch:
            run = self.queue[0]
            held = self.cache.held(run.key)
            reused = min(held, run.prefix)
            if run.prompt - reused + run.answer > self.config.kv_tokens:
                raise ValueError(f"run {run.id} needs {run.prompt + run.answer} tokens; "
                                 f"a replica holds {self.config.kv_tokens}")
            took = bool(reused) and not run.pinned
            if took:                             # before make_room: it must stay
                self.cache.pin(run.key)
                run.pinned = True
            if not self.cache.make_room(run.prompt - reused + run.answer):
                if took:
                    self.cache.unpin(run.key)
                    run.pinned = False
                return
            run.reused = reused
            self.cache.private += run.own_tokens
            self.queue.pop(0)
            self.running.append(run)

    def plan(self, costs: Costs) -> float:
        """This step's chunks; returns its seconds."""
        self.chunk.clear()
        decoding = [r for r in self.running if r.computed == r.prompt - r.reused]
        budget = self.config.max_step_tokens - len(decoding)
        prefill, pairs = 0, 0.0
        for r in self.running:
            todo = r.prompt - r.reused - r.computed
            if todo and budget > 0:
                n = self.chunk[r.id] = min(todo, budget)
                budget -= n
                prefill += n
                pairs += n * (r.reused + r.computed + n / 2)
        context = sum(r.prompt + r.decoded for r in decoding)
        return costs.step_time(prefill, pairs, len(decoding), context)

    def advance(self) -> list[Run]:
        """Apply the planned step; returns the runs that finished."""
        done = []
        for r in self.running:
            was_decoding = r.computed == r.prompt - r.reused
            r.computed += self.chunk.get(r.id, 0)
            if was_decoding or r.computed == r.prompt - r.reused:
                r.decoded += 1
            if r.decoded >= r.answer:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self.cache.private -= r.own_tokens
            if r.pinned:
                self.cache.unpin(r.key)
                r.pinned = False
        return done


# ------------------------------------------------------------------ the event loop

class Workload:
    """Closed-loop clients: `next(client, done)` is the gap before that client's next
    run and the run (its ids unset), `done` being the run it just finished (None at
    the start)."""
    name = "workload"

    def next(self, client: int, done: Run | None) -> tuple[float, Run]:
        raise NotImplementedError


@dataclass
class Result:
    workload: str
    policy: str
    replicas: int
    runs: int                    # measured: those that finished after the warm-up
    seconds: float
    hits: int
    named: int                   # measured runs whose named cache could exist (prefix > 0)
    latencies: list[float]
    migrations: int
    bytes_migrated: int
    evictions: int

    @property
    def throughput(self) -> float:
        return self.runs / self.seconds if self.seconds else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.named if self.named else 0.0

    def latency(self, q: float) -> float:
        xs = sorted(self.latencies)
        if not xs:
            return math.nan
        at = (len(xs) - 1) * q / 100
        lo = int(at)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


ISSUE, ARRIVE, STEP = 0, 1, 2


class Cluster:
    """N replicas, one policy, clients driving them; `run(requests, warmup)` measures
    the runs that finish after the first `warmup`, up to `requests` finished."""

    def __init__(self, n: int, policy, workload: Workload, clients: int, costs: Costs,
                 config: ReplicaConfig = ReplicaConfig()) -> None:
        self.replicas = [Replica(i, config) for i in range(n)]
        self.policy, self.workload, self.costs = policy, workload, costs
        self.clients = clients
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.ids = 0
        self.placed: list[tuple[int, int, int | None]] = []   # (run id, replica, source)

    def push(self, t: float, kind: int, obj: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, obj))

    def events(self) -> Iterator[tuple[float, list[Run]]]:
        """(time, runs finished then) after each step; issues and arrivals in between."""
        for c in range(self.clients):
            gap, run = self.workload.next(c, None)
            run.client = c
            self.push(gap, ISSUE, run)
        while self.heap:
            t, _, kind, obj = heapq.heappop(self.heap)
            if kind == ISSUE:
                self.issue(t, obj)
            elif kind == ARRIVE:
                self.arrive(t, obj)
            else:
                done = self.finish(t, obj)
                if done:
                    yield t, done

    def issue(self, t: float, run: Run) -> None:
        self.ids += 1
        run.id, run.issued = self.ids, t
        where = self.policy.place(run, self.replicas, self.costs)
        self.placed.append((run.id, where.replica, where.migrate_from))
        target = self.replicas[where.replica]
        run.replica = target.index
        target.in_flight += 1
        if where.migrate_from is None:
            self.enqueue(t, run)
            return
        tokens = min(self.replicas[where.migrate_from].cache.held(run.key), run.prefix)
        run.migrated = tokens * self.costs.kv_bytes_per_token
        self.push(t + self.costs.migrate_time(tokens), ARRIVE, (run, tokens))

    def arrive(self, t: float, what: tuple[Run, int]) -> None:
        """A copy has been imported: it becomes the target's entry, held for the run."""
        run, tokens = what
        cache = self.replicas[run.replica].cache
        if cache.held(run.key) < tokens and cache.put(run.key, tokens):
            cache.pin(run.key)
            run.pinned = True
        self.enqueue(t, run)

    def enqueue(self, t: float, run: Run) -> None:
        r = self.replicas[run.replica]
        r.queue.append(run)
        if not r.busy:
            self.start_step(t, r)

    def start_step(self, t: float, r: Replica) -> None:
        r.admit()
        if not r.running:
            r.busy = False
            if r.queue:
                raise RuntimeError(f"replica {r.index}: run {r.queue[0].id} cannot fit "
                                   f"though nothing runs (kv_tokens too small)")
            return
        r.busy = True
        self.push(t + r.plan(self.costs), STEP, r)

    def finish(self, t: float, r: Replica) -> list[Run]:
        done = r.advance()
        for run in done:
            run.finished = t
            r.in_flight -= 1
            if run.last:
                for x in self.replicas:
                    x.cache.drop(run.key)
            elif run.key is not None and run.keep:
                r.cache.put(run.key, run.keep)
            gap, nxt = self.workload.next(run.client, run)
            nxt.client = run.client
            self.push(t + gap, ISSUE, nxt)
        self.start_step(t, r)
        return done

    def run(self, requests: int, warmup: int) -> Result:
        measured: list[Run] = []
        finished, t0, t = 0, 0.0, 0.0
        for t, done in self.events():
            for run in done:
                finished += 1
                if finished == warmup:
                    t0 = t
                elif finished > warmup:
                    measured.append(run)
            if finished >= requests:
                break
        named = [r for r in measured if r.prefix > 0]
        moved = [r for r in measured if r.migrated]
        return Result(self.workload.name, self.policy.name, len(self.replicas),
                      len(measured), t - t0, sum(r.hit for r in named), len(named),
                      [r.finished - r.issued for r in measured], len(moved),
                      sum(r.migrated for r in moved),
                      sum(len(x.cache.evicted) for x in self.replicas))
