"""Speculative continuation: the step after a token predd chose, run before it is asked.

When predd answers a pred_sample with one token it chose, the program's next call very
likely appends exactly that token and asks for the next one. predd queues that step at
once (`offer`), so it runs in the next batch while the answer travels to the program and
the program decides; the program's call then takes the answer computed in that batch
(or joins the step still queued) instead of missing a batch. Where a step is fast (a
GPU) a program that samples each token otherwise runs at about half the built-in loop's
pace. A raw `pred` (one row of logits) is followed the same way with the row's argmax,
once that object's calls have been appending the argmax (`guess`: a hit rate kept per
object, decayed by a quarter a call, speculating from HIT_RATE).

A speculation is an ordinary `Call` in the scheduler with no client (`speculative`): its
object counts as busy (the memory policy leaves its pages on the device) and its token's
slot is reserved, never an entry. When computed it is `parked`: not committed, its
outputs kept (the greedy picks, or its logits copied) for the reply, which is built for
the call that takes it (so a raw row goes into that call's logits buffer slot).

Match rule: a pred from the same session appending exactly that token (positions unset
or the same), one output, the same sampling parameters (or none, for logits), no mask
and no top-k takes the speculation (`claim`); any other request naming the object
discards it first.

Invisibility rule: a discarded speculation is `calls.undo`ne — its reservation released,
nothing committed — so forks, `kv_tokens`, `kv_stat`, exports and files never see it,
and `fsck` (which discards all first) stays clean. Every request naming the object
discards its speculation unless it takes it. No request fails for a speculation's page:
a request refused EDQUOT or ENOSPC while speculations hold pages has them dropped (its
uid's, or all) and runs again; a call that finds no room or quota at admission has them
dropped before the next step and waits that step. Until then a speculation's page counts
in `ps` and `stats` as any call in flight does.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import symphony_protocol as p
from predd.engine import calls, sampling
from predd.engine.calls import Call
from predd.server.quotas import add_count

if TYPE_CHECKING:
    from predd.memory.kvstore import KVStore
    from predd.engine.scheduler import Scheduler

MODES = ("auto", "on", "off")
HIT_RATE = 0.6         # a pred loop's argmax is speculated once this share of calls took it

# Requests that neither read nor change a KV object or a quota: they leave speculations be.
ROOM_ERRORS = ("EDQUOT", "ENOSPC")   # what a speculation's page may cause another to get
QUICK_FIELDS = frozenset({"op", "rid", "cap", "tokens", "sample", "into"})
NEUTRAL = (p.Hello, p.Bye, p.Ping, p.Info, p.Stats, p.Ps, p.Tokenize, p.Detokenize,
           p.TokenizerSpec, p.ChatTemplate)


def enabled(mode: str, device: str) -> tuple[bool, str]:
    """Whether to speculate and why. `auto`: on a GPU, where a step is shorter than a
    program's round trip; not on a CPU, where the adaptive launch already waits for the
    programs and a speculation's step competes with them for the cores (measured:
    docs/benchmarks.md, "B6: per-token overhead (`scripts/bench_loop.py`)")."""
    if mode not in MODES:
        raise ValueError(f"speculate must be one of {MODES}, not {mode!r}")
    if mode != "auto":
        return mode == "on", f"{mode} (--speculate {mode})"
    if device.startswith("cuda"):
        return True, f"on (auto: on {device} a pred_sample loop otherwise misses a batch a token)"
    return False, ("off (auto: on a CPU the adaptive launch waits for the programs and a "
                   "speculated step competes with them for the cores)")


@dataclass
class SpeculationStats:
    offered: int = 0    # speculations queued
    hits: int = 0       # taken by the program's next call
    misses: int = 0     # discarded (another call, a change, the session or object gone)
    wasted: int = 0     # tokens computed for speculations that were discarded

    def wire(self) -> dict:
        return {"offered": self.offered, "hits": self.hits, "misses": self.misses,
                "wasted": self.wasted}


class Speculation:
    """The speculations in flight or computed, one per object at most."""

    def __init__(self, on: bool, scheduler: Scheduler, store: KVStore) -> None:
        self.on = on
        self.scheduler = scheduler
        self.store = store
        self.by_oid: dict[int, Call] = {}
        # speculations per session and uid (plain dicts: a Counter's `del` is Python)
        self._of_session: dict[int, int] = {}
        self._of_uid: dict[int, int] = {}
        self.stats = SpeculationStats()
        self.guesses: dict[int, tuple[int, float]] = {}   # oid -> (argmax told, hit rate)
        self.drop_all = False     # a call found no room: drop every one before the next step
        self.hold_off = False     # ... and admit none in that step

    def __len__(self) -> int:
        return len(self.by_oid)

    def of_session(self, sid: int) -> int:
        return self._of_session.get(sid, 0)

    def of_uid(self, uid: int) -> int:
        return self._of_uid.get(uid, 0)

    def _put(self, spec: Call) -> None:
        self.by_oid[spec.oid] = spec
        add_count(self._of_session, spec.session, 1)
        add_count(self._of_uid, spec.uid, 1)

    def _take(self, oid: int) -> Call | None:
        """`oid`'s speculation out of the table (not out of the queue), if any."""
        spec = self.by_oid.pop(oid, None)
        if spec is not None:
            add_count(self._of_session, spec.session, -1)
            add_count(self._of_uid, spec.uid, -1)
        return spec

    def _missed(self, spec: Call) -> None:
        self.stats.misses += 1
        self.stats.wasted += spec.computed

    # ------------------------------------------------------------ making one

    def guess(self, oid: int, row: torch.Tensor) -> int | None:
        """After a raw one-row pred on `oid`: its argmax, to speculate with where that
        object's calls have been appending the argmax; None where they have not (the
        argmax is noted to measure them)."""
        # numpy's argmax over a CPU float32 row (docs/kernels.md, "Speculation's argmax
        # by numpy"); both give the first of equal maxima, and a NaN first
        token = int(row.numpy().argmax()) if row.device.type == "cpu" and \
            row.dtype == torch.float32 else int(torch.argmax(row))
        rate = self.guesses.get(oid, (0, HIT_RATE - 0.1))[1]
        self.guesses[oid] = (token, rate)
        return token if rate >= HIT_RATE else None

    def _measure(self, req: p.Request, oids: list[int]) -> None:
        if isinstance(req, p.Pred) and len(oids) == 1:
            self.measure(oids[0], req.tokens)

    def measure(self, oid: int, tokens: list[int]) -> None:
        """A pred appending `tokens` to an object whose last raw row's argmax was noted:
        one more hit or miss for its rate."""
        if oid in self.guesses:
            told, rate = self.guesses[oid]
            hit = len(tokens) == 1 and tokens[0] == told
            self.guesses[oid] = (told, 0.75 * rate + 0.25 * hit)

    def forget(self, oid: int) -> None:
        self.guesses.pop(oid, None)

    def offer(self, done: Call, token: int, now: float, holds: bool, context: int) -> None:
        """After `done` (a pred) was answered: queue its object's next step with `token`
        (the token predd chose, or the argmax), unless the object has another call or a
        held change (`holds`), the call was masked or asked for top-k, or the object is
        full."""
        if not self.on or done.allowed is not None or done.topk or done.oid in self.by_oid:
            return
        obj = self.store.objects.get(done.oid)
        if obj is None or holds or obj.length + 1 > context or \
                self.scheduler.calls_on(done.oid):
            return
        spec = Call(done.session, done.oid, total=1, uid=done.uid, identity=b"", rid=-1,
                    tokens=[token], outputs=[0], sample=done.sample,
                    sample_wire=done.sample_wire,
                    generator=sampling.make_generator(done.sample), speculative=True)
        self.scheduler.submit(spec, now)
        self._put(spec)
        self.stats.offered += 1

    # ------------------------------------------------------------ taking one

    def may_claim(self, sid: int, req: p.Request, oid: int) -> bool:
        """Whether `req` (naming object `oid`) could take its speculation: a pred of the
        speculation's session appending one token. The handler's call decides
        (`claim`); anything else discards it (`settle`)."""
        spec = self.by_oid.get(oid)
        return (spec is not None and isinstance(req, p.Pred) and spec.session == sid
                and len(req.tokens) == 1)

    def matches(self, spec: Call, call: Call) -> bool:
        return (call.session == spec.session and call.tokens == spec.tokens
                and (call.positions is None or call.positions == spec.positions)
                and call.outputs == [0] and call.sample == spec.sample
                and call.allowed is None and not call.topk)

    def taken_by(self, sid: int, oid: int, header: dict) -> Call | None:
        """The speculation on `oid`, computed (`parked`) or still queued, that the raw
        pred map `header` of session `sid` takes, where the full path (decode_request,
        the pred handler, `claim`) would accept the map and give it that speculation: no
        fields but op, rid, cap, tokens, sample and into; rid, into and the one token
        plain ints, the token the speculation's; the sample map the one its chain began
        with, key for key, of the same values and types. None: the full path decides.
        The caller checks the capability and the call limits as the full path does."""
        spec = self.by_oid.get(oid)
        if spec is None or spec.session != sid or not header.keys() <= QUICK_FIELDS:
            return None
        tokens, sample = header.get("tokens"), header.get("sample")
        if (type(tokens) is not list or len(tokens) != 1 or type(tokens[0]) is not int
                or tokens[0] != spec.tokens[0] or type(header.get("rid")) is not int
                or type(header.get("into", -1)) is not int
                or not _same_map(sample, spec.sample_wire)):
            return None
        return spec

    def claim(self, call: Call) -> Call | None:
        """Give `call` its object's speculation if it matches; None when nothing does (a
        speculation there is discarded). The speculation becomes `call` (its client, its
        request, its logits buffer slot): when computed (`parked`) it is answered at
        once (Engine.claimed: the reply built, then its token committed); still queued,
        it is answered when computed."""
        spec = self.by_oid.get(call.oid)
        if spec is None:
            return None
        if not self.matches(spec, call):
            self.discard(call.oid)
            return None
        return self.take(spec, call.identity, call.rid, call.generator, call.buffer,
                         call.into)

    def take(self, spec: Call, identity: bytes, rid: int, generator, buffer,
             into: int) -> Call:
        """`spec` becomes the call of the client `identity` (its request `rid`, its
        generator, its logits buffer slot)."""
        self._take(spec.oid)
        self.stats.hits += 1
        spec.speculative = False
        spec.identity, spec.rid, spec.generator = identity, rid, generator
        spec.buffer, spec.into = buffer, into
        return spec

    # ------------------------------------------------------------ dropping them

    def before_step(self) -> None:
        """Where a call found no room or quota in the last step, drop every speculation
        and admit none in this one, so the call is not starved by them."""
        self.hold_off = self.drop_all
        if self.drop_all:
            self.drop_all = False
            self.discard_where()

    def discard(self, oid: int) -> None:
        """Drop `oid`'s speculation, if any: out of the queue, its reservation released."""
        spec = self._take(oid)
        if spec is None:
            return
        self.scheduler.remove(spec)
        calls.undo(spec, self.store)
        self._missed(spec)

    def discard_where(self, keep=lambda c: False) -> int:
        """Drop every speculation `keep` does not keep; how many were dropped."""
        gone = [oid for oid, c in self.by_oid.items() if not keep(c)]
        for oid in gone:
            self.discard(oid)
        return len(gone)

    def gone(self, call: Call) -> None:
        """A speculation left the queue without a claim (its session or object ended, it
        failed, admission refused it): forget it; the caller has undone it."""
        if self.by_oid.get(call.oid) is call:
            self._take(call.oid)
            self._missed(call)

    def settle(self, sid: int, req: p.Request, oids: list[int]) -> None:
        """Before `req` is handled: discard what it must not see or would not take."""
        if self.guesses:
            self._measure(req, oids)
        if not self.by_oid or isinstance(req, NEUTRAL):
            return
        if isinstance(req, (p.Fsck, p.KvPolicy)):   # fsck; an eviction, which must not
            self.discard_where()                      # find a fork's pages kept busy
            return
        if isinstance(req, p.IoWait) and not req.caps:    # every object of the session
            self.discard_where(lambda c: c.session != sid)
            return
        for oid in oids:
            if not self.may_claim(sid, req, oid):
                self.discard(oid)

    def make_room(self, code: str | None) -> bool:
        """A request was refused `code`: where that is no quota or no room and
        speculations hold pages, drop them all (a page is charged to its object's owner,
        who need not be the one who speculated); whether the request is worth trying
        again."""
        return code in ROOM_ERRORS and self.discard_where() > 0

    def check(self) -> list[str]:
        problems = []
        for oid, spec in self.by_oid.items():
            if not spec.speculative or spec.oid != oid:
                problems.append(f"speculation on object {oid} is call {spec.rid} of "
                                f"object {spec.oid}")
            elif spec not in self.scheduler.calls_on(oid):
                problems.append(f"speculation on object {oid} is not queued")
        counted = dict(Counter(c.session for c in self.by_oid.values())), \
            dict(Counter(c.uid for c in self.by_oid.values()))
        if counted != (self._of_session, self._of_uid):
            problems.append(f"speculations counted per session and uid {self._of_session}, "
                            f"{self._of_uid}; found {counted}")
        return problems


def _same_map(got: object, kept: dict | None) -> bool:
    """Whether `got` is `kept` (None, or a map of the same keys, values and types)."""
    if got is None or kept is None:
        return got is None and kept is None
    return (type(got) is dict and got.keys() == kept.keys()
            and all(type(v) is type(kept[k]) and v == kept[k] for k, v in got.items()))
