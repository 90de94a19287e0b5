"""The engine: requests in, replies out; one step = schedule -> execute -> update.

Everything here runs on one thread (the server loop), so there are no locks. Ordering
rule: requests that change an object (pred, generate, kv_truncate, kv_free) are applied
in arrival order: a call waits in the scheduler, and a change on an object with queued
calls (or earlier deferred changes) is deferred and replayed when they are done.
Requests that only read an object (stat, tokens, fork, grant, extract, merge, export)
answer at once from its committed entries — a snapshot — so `ls` or `cp` on a cache
never waits for a long generation on it.

Identity rule: a request's session, uid and trust come from `Peer` (the kernel's
credentials on ipc, a token on authenticated tcp), never from the request itself; see
predd/identity.py. Limits (quota.py) are checked here at the door: the request rate and
sessions per uid when a message arrives, calls in flight when one is queued.
"""
from __future__ import annotations

import bisect
import itertools
import os
import time
import traceback

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from liblip import protocol as p
from liblip.protocol import ProtocolError, error_reply, ok_reply
from predd import sampling
from predd.calls import CallState
from predd.caps import Capabilities, Capability
from predd.identity import AuthKeys, Peer, identify
from predd.kvops import KVOps
from predd.kvstore import KVStore
from predd.limits import MAX_POSITION, Limits
from predd.pool import Pool
from predd.quota import QuotaConfig, Quotas, check_limit
from predd.runner import Chunk, Runner
from predd.scheduler import Call, Plan, PlanItem, Scheduler, SchedulerConfig
from predd.sessions import Session, Sessions
from predd.tokenizer import Tokenizer

Send = Callable[[bytes, dict, list[bytes]], None]
CHANGES = frozenset({"pred", "generate", "kv_truncate", "kv_free"})
QUEUED = frozenset({"pred", "generate"})


@dataclass(frozen=True)
class EngineConfig:
    lease_s: float = 10.0
    scheduler: SchedulerConfig = SchedulerConfig()
    quota: QuotaConfig = QuotaConfig()
    limits: Limits = Limits()
    trusted_uid: int = field(default_factory=os.geteuid)   # predd's own: kvfsd, the operator
    auth: AuthKeys | None = None                             # tcp tokens (--auth-keys)


HIST_MS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)   # bucket bounds


@dataclass
class Histogram:
    """Counts per bucket (upper bounds HIST_MS, then +inf) and the sum, in ms."""
    counts: list[int] = field(default_factory=lambda: [0] * (len(HIST_MS) + 1))
    sum_ms: float = 0.0

    def observe(self, ms: float) -> None:
        self.counts[bisect.bisect_left(HIST_MS, ms)] += 1
        self.sum_ms += ms

    def wire(self) -> dict:
        """Cumulative counts per upper bound, as Prometheus histograms are read."""
        return {"le_ms": list(HIST_MS), "cumulative": list(itertools.accumulate(self.counts)),
                "sum_ms": round(self.sum_ms, 3)}


@dataclass
class Counters:
    steps: int = 0
    calls: int = 0
    tokens_computed: int = 0
    tokens_reused: int = 0
    queue_wait_s: float = 0.0
    step_s: float = 0.0
    requests: int = 0
    errors: int = 0
    throttled: int = 0        # EAGAIN replies (rate, calls in flight, sessions)
    queue_hist: Histogram = field(default_factory=Histogram)   # per admitted call
    step_hist: Histogram = field(default_factory=Histogram)    # per forward pass


class Engine(KVOps):
    def __init__(self, runner: Runner, tokenizer: Tokenizer, config: EngineConfig,
                 send: Send, log: Callable[[str], None] = lambda msg: None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.send = send
        self.log = log
        self.pool = Pool(runner.config.kv_pages, runner.config.page_size)
        self.quotas = Quotas(config.quota, self.pool.num_pages, config.trusted_uid)
        self.store = KVStore(self.pool, runner.cache, on_resize=self.quotas.resized)
        self.caps = Capabilities(self._free_object)
        self.sessions = Sessions(config.lease_s)
        self.scheduler = Scheduler(config.scheduler)
        self.counters = Counters()
        self.deferred: dict[int, list[tuple[bytes, p.Request, list[bytes]]]] = {}
        self.deferred_of_uid: dict[int, int] = {}
        self.vocab = runner.model_config.vocab_size
        self.limits = config.limits.resolved(runner.model_config.max_position)
        self.started = time.monotonic()

    # ------------------------------------------------------------ requests

    @property
    def max_message_bytes(self) -> int:
        """The largest request worth receiving: a kv_import of the most pages one uid
        may hold (its tokens and positions included), plus slack for the header."""
        pages = self.quotas.uid_pages or self.pool.num_pages
        return pages * (self.runner.cache.bytes_per_page + 10 * self.pool.page_size) + 2**20

    def handle(self, identity: bytes, frames: list[bytes], now: float, peer: Peer) -> None:
        """Answer one raw message from `peer` (or queue it); never raises."""
        self.counters.requests += 1
        rid = None
        try:
            header, extra = p.decode_frames(frames)
            rid = header.get("rid") if isinstance(header.get("rid"), int) else None
            session = self.sessions.of_identity(identity)
            if session is not None:
                if peer.address != session.peer:
                    raise ProtocolError("EPERM", "this connection's credentials are not "
                                        "those of the session it names")
                session.last_seen = now
                if not session.allow(now, self.config.quota.rate, self.config.quota.burst):
                    raise ProtocolError("EAGAIN", f"more than {self.config.quota.rate:g} "
                                        "requests per second: slow down")
            request = p.decode_request(header)
            if session is None:
                session = self._open_session(identity, peer, request, now)
            self._dispatch(identity, session, request, extra, now)
        except ProtocolError as exc:
            if exc.code == "EAGAIN":
                self.counters.throttled += 1
            self._error(identity, rid, exc)
        except Exception as exc:  # a bug must not take the daemon down
            self.log(f"internal error on request {rid}: {type(exc).__name__}: {exc}")
            self._error(identity, rid, ProtocolError("EIO", f"internal error: {exc}"))

    def _error(self, identity: bytes, rid: int | None, exc: ProtocolError) -> None:
        self.counters.errors += 1
        self.send(identity, error_reply(rid, exc.code, exc.message), [])

    def _open_session(self, identity: bytes, peer: Peer, request: p.Request,
                      now: float) -> Session:
        """A session for a routing identity's first request, bound to `peer`."""
        c = self.config
        token = request.token if isinstance(request, p.Hello) else None
        uid, pid, via = identify(peer, token, c.auth)
        trusted = via == "kernel" and uid == c.trusted_uid
        if not trusted:
            check_limit(self.sessions.count(uid), c.quota.uid_sessions, "EAGAIN",
                        f"sessions of uid {uid}")
        session = self.sessions.open(identity, now, uid=uid, via=via, peer=peer.address,
                                     pid=pid, trusted=trusted, burst=c.quota.burst)
        session.allow(now, c.quota.rate, c.quota.burst)   # the opening request counts
        return session

    def _check_calls(self, s: Session) -> None:
        """EAGAIN when `s` or its uid has as many calls in flight as allowed."""
        q = self.config.quota
        check_limit(self.scheduler.queued(session=s.sid) + s.deferred, q.session_calls,
                    "EAGAIN", f"calls in flight of session {s.sid}")
        if not s.trusted:
            check_limit(self.scheduler.queued(uid=s.uid) + self.deferred_of_uid.get(s.uid, 0),
                        q.uid_calls, "EAGAIN", f"calls in flight of uid {s.uid}")

    def _count_deferred(self, s: Session, n: int) -> None:
        s.deferred += n
        left = self.deferred_of_uid.get(s.uid, 0) + n
        if left:
            self.deferred_of_uid[s.uid] = left
        else:
            self.deferred_of_uid.pop(s.uid, None)

    def _dispatch(self, identity: bytes, session: Session, req: p.Request,
                  extra: list[bytes], now: float) -> None:
        oids = self._objects_of(req)
        if req.op in CHANGES and any(self.scheduler.busy(o) or self.deferred.get(o)
                                     for o in oids):
            # Wait behind the object's earlier requests (keyed on the first busy one).
            self._check_calls(session)
            key = next(o for o in oids if self.scheduler.busy(o) or self.deferred.get(o))
            self.deferred.setdefault(key, []).append((identity, req, extra))
            self._count_deferred(session, 1)
            return
        if req.op in QUEUED:
            self._check_calls(session)
        handler = getattr(self, "op_" + req.op)
        result = handler(session, req, extra, now)
        if result is not None:
            head, frames = result if isinstance(result, tuple) else (result, [])
            self.send(identity, ok_reply(req.rid, **head), frames)

    def _objects_of(self, req: p.Request) -> list[int]:
        tokens = [req.cap] if hasattr(req, "cap") else list(getattr(req, "caps", []))
        return [self.caps.lookup(t).oid for t in tokens]

    def replay_deferred(self, now: float) -> None:
        for oid in list(self.deferred):
            if self.scheduler.busy(oid):
                continue
            queue = self.deferred.pop(oid)
            while queue:
                identity, req, extra = queue.pop(0)
                session = self.sessions.of_identity(identity)
                if session is None:
                    continue
                self._count_deferred(session, -1)
                try:
                    self._dispatch(identity, session, req, extra, now)
                except Exception as exc:   # this request's error alone, never the loop's
                    self._error(identity, req.rid, self._errno(exc, f"request {req.rid}"))
                if self.scheduler.busy(oid) and queue:
                    self.deferred.setdefault(oid, [])[:0] = queue
                    break

    def _cap(self, token: str, write: bool = False) -> Capability:
        return self.caps.lookup(token, write)

    # ------------------------------------------------------------ sessions

    def op_hello(self, s: Session, r: p.Hello, extra, now) -> dict:
        if not 0 < r.lease_s < 1e6:
            raise ProtocolError("EINVAL", "lease_s must be a positive number of seconds")
        if r.uid != -1 and r.uid != s.uid:
            source = {"kernel": "the kernel (SO_PEERCRED)", "token": "its token"}.get(
                s.via, "an unauthenticated tcp endpoint (nobody)")
            raise ProtocolError("EPERM", f"hello declares uid {r.uid}, but this session "
                                f"is uid {s.uid} by {source}; the uid is never the client's "
                                "to choose")
        if r.token and s.via == "token" and self.config.auth.uid_of(r.token) != s.uid:
            raise ProtocolError("EPERM", f"hello: the token names another uid than this "
                                f"session's ({s.uid})")
        if s.via != "kernel":
            s.pid = r.pid           # only for ps: the kernel cannot tell
        s.client, s.lease_s = r.client, r.lease_s
        return {"session": s.sid, "version": p.PROTOCOL_VERSION, "lease_s": s.lease_s,
                "model": self.runner.model_config.name, "uid": s.uid, "trusted": s.trusted}

    def op_bye(self, s: Session, r, extra, now) -> dict:
        self.end_session(s, "bye")
        return {}

    def op_ping(self, s, r, extra, now) -> dict:
        return {}

    def end_session(self, s: Session, why: str) -> None:
        dropped = self.scheduler.cancel(lambda c: c.session == s.sid)
        for call in dropped:
            self._undo(call)
        for oid, queue in list(self.deferred.items()):
            queue[:] = [q for q in queue if q[0] != s.identity]
            if not queue:
                del self.deferred[oid]
        self._count_deferred(s, -s.deferred)
        freed = self.caps.revoke_session(s.sid)
        self.sessions.end(s.sid)
        self.log(f"session {s.sid} ({s.client or 'anonymous'} pid {s.pid}) ended ({why}): "
                 f"{freed} capabilities revoked, {len(dropped)} calls dropped")

    def expire_sessions(self, now: float) -> None:
        for s in self.sessions.expired(now):
            self.end_session(s, "lease expired")

    def _free_object(self, oid: int) -> None:
        for call in self.scheduler.cancel(lambda c: c.oid == oid):
            st: CallState = call.payload
            self.send(st.identity, error_reply(st.rid, "EBADF", "KV object was freed"), [])
        for identity, req, _ in self.deferred.pop(oid, []):
            session = self.sessions.of_identity(identity)
            if session is not None:
                self._count_deferred(session, -1)
            self.send(identity, error_reply(req.rid, "EBADF", "KV object was freed"), [])
        self.scheduler.forget(oid)
        self.quotas.forget(oid)
        self.store.free(oid)

    # ------------------------------------------------------------ info

    def info(self) -> dict:
        cfg = self.runner.model_config
        return {"model": cfg.name, "vocab_size": cfg.vocab_size,
                "eos_ids": list(self.tokenizer.eos_ids), "bos_id": self.tokenizer.bos_id,
                "page_size": self.pool.page_size, "pages_total": self.pool.num_pages,
                "pages_free": self.pool.free_pages,
                "bytes_per_page": self.runner.cache.bytes_per_page,
                "max_position": cfg.max_position, "device": self.runner.config.device,
                "dtype": self.runner.config.dtype,
                "dtype_reason": self.runner.config.dtype_reason,
                "attention": self.runner.backend.name,
                "num_layers": cfg.num_layers, "version": p.PROTOCOL_VERSION,
                "max_message_bytes": self.max_message_bytes}

    def op_info(self, s, r, extra, now) -> dict:
        return self.info()

    def op_stats(self, s, r, extra, now) -> dict:
        c = self.counters
        return {"pages_total": self.pool.num_pages, "pages_free": self.pool.free_pages,
                "pages_used": self.pool.used_pages, "objects": len(self.store.objects),
                "capabilities": len(self.caps), "sessions": len(self.sessions),
                "steps": c.steps, "calls": c.calls,
                "mean_batch": round(c.calls / c.steps, 3) if c.steps else 0.0,
                "tokens_computed": c.tokens_computed, "tokens_reused": c.tokens_reused,
                "queue_wait_ms": round(c.queue_wait_s * 1e3, 3),
                "step_ms": round(c.step_s * 1e3, 3),
                "launch_wait_ms": round(self.scheduler.waited_s * 1e3, 3),
                "pending_calls": self.scheduler.pending(), "requests": c.requests,
                "errors": c.errors, "throttled": c.throttled,
                "capped_steps": self.scheduler.capped_steps,
                "queue_wait_hist": c.queue_hist.wire(), "step_hist": c.step_hist.wire(),
                "uptime_s": round(time.monotonic() - self.started, 3)}

    def op_ps(self, s: Session, r, extra, now) -> dict:
        """Sessions of the caller's uid (every session for a trusted caller), and what
        each uid holds against its limits."""
        visible = list(self.sessions) if s.trusted else self.sessions.of_uid(s.uid)
        rows = [{"session": x.sid, "client": x.client, "pid": x.pid, "uid": x.uid,
                 "via": x.via, "trusted": x.trusted,
                 "objects": self.quotas.objects_of_session.get(x.sid, 0),
                 "pages": self.quotas.pages_of_session.get(x.sid, 0),
                 "capabilities": self.caps.count(x.sid),
                 "calls": self.scheduler.queued(session=x.sid) + x.deferred,
                 "tokens_computed": x.tokens_computed, "tokens_reused": x.tokens_reused,
                 "idle_s": round(now - x.last_seen, 3)} for x in visible]
        ended = [{"session": x.sid, "pid": x.pid, "uid": x.uid,
                  "tokens_computed": x.tokens_computed, "tokens_reused": x.tokens_reused}
                 for x in self.sessions.ended if s.trusted or x.uid == s.uid]
        uids = sorted({x.uid for x in visible} | {s.uid})
        return {"sessions": rows, "ended": ended, "uids": [
            {**self.quotas.usage(u), "sessions": self.sessions.count(u),
             "calls": self.scheduler.queued(uid=u) + self.deferred_of_uid.get(u, 0)}
            for u in uids]}

    def op_fsck(self, s, r, extra, now) -> dict:
        problems = self.fsck()
        return {"clean": not problems, "problems": problems,
                "pages_total": self.pool.num_pages, "pages_free": self.pool.free_pages,
                "objects": len(self.store.objects)}

    def fsck(self) -> list[str]:
        problems = self.store.check()
        live = self.caps.objects()
        for oid in self.store.objects:
            if oid not in live:
                problems.append(f"object {oid} has no capability (leaked)")
        for oid in live - set(self.store.objects):
            problems.append(f"capability to missing object {oid}")
        problems += self.caps.check()
        problems += self.quotas.verify(self.store.objects)
        problems += self.scheduler.check()
        held: dict[int, int] = {}
        for queue in self.deferred.values():
            for identity, _, _ in queue:
                x = self.sessions.of_identity(identity)
                uid = x.uid if x is not None else None
                held[uid] = held.get(uid, 0) + 1
        if held != self.deferred_of_uid:
            problems.append(f"held requests per uid counted {self.deferred_of_uid}, "
                            f"found {held}")
        return problems

    # ------------------------------------------------------------ text

    def op_tokenize(self, s, r: p.Tokenize, extra, now) -> dict:
        self.limits.check_text("tokenize.text", r.text)
        return {"tokens": self.tokenizer.encode(r.text, add_special=r.add_special)}

    def op_detokenize(self, s, r: p.Detokenize, extra, now) -> dict:
        self.limits.count("detokenize.tokens", r.tokens, self.limits.text_tokens)
        self.limits.ids("detokenize.tokens", r.tokens, self.vocab)
        return {"text": self.tokenizer.decode(r.tokens, skip_special=r.skip_special)}

    def op_chat_template(self, s, r: p.ChatTemplate, extra, now) -> dict:
        self.limits.check_messages(r.messages)
        try:
            text = self.tokenizer.apply_chat_template(r.messages, r.add_generation_prompt)
        except Exception as exc:
            raise ProtocolError("EINVAL", f"chat template failed: {exc}") from None
        return {"text": text, "tokens": self.tokenizer.encode(text)}

    # ------------------------------------------------------------ pred / generate

    def op_pred(self, s: Session, r: p.Pred, extra, now) -> None:
        cap = self._cap(r.cap, write=True)
        self.limits.check_pred(r, self.vocab)
        n = len(r.tokens)
        if n == 0:   # re-predict from the last entry: it becomes the one token
            if r.outputs not in (None, [0], [-1]):
                raise ProtocolError("EINVAL", "with no tokens only output 0 exists")
            outputs = [0]
        else:
            outputs = [n - 1] if r.outputs is None else r.outputs
            if any(not -n <= o < n for o in outputs):
                raise ProtocolError("EINVAL", f"outputs must index the {n} tokens")
            outputs = [o % n for o in outputs]
        sample = p.SampleParams.from_wire(r.sample)
        state = CallState(s.identity, r.rid, "pred", list(r.tokens), r.positions, outputs,
                          sample, sampling.mask_tensor(r.mask, self.vocab), topk=r.topk,
                          generator=sampling.make_generator(sample), arrival=now)
        self._submit(s, cap.oid, state, now)

    def op_generate(self, s: Session, r: p.Generate, extra, now) -> None:
        cap = self._cap(r.cap, write=True)
        self.limits.check_generate(r, self.vocab)
        sample = p.SampleParams.from_wire(r.sample)
        stop = self.tokenizer.eos_ids if r.stop is None else r.stop
        state = CallState(s.identity, r.rid, "generate", list(r.tokens), None, [],
                          sample, None, max_tokens=r.max_tokens, stop=frozenset(stop),
                          stop_text=tuple(r.stop_text), stream=r.stream,
                          generator=sampling.make_generator(sample), arrival=now)
        self._submit(s, cap.oid, state, now)

    def _submit(self, s: Session, oid: int, state: CallState, now: float) -> None:
        if not state.tokens and self.store.get(oid).length == 0:
            raise ProtocolError("EINVAL", "no tokens and an empty cache: nothing to predict from")
        call = Call(s.sid, oid, total=max(len(state.tokens), 1),
                    generating=state.op == "generate", payload=state, uid=s.uid)
        self.scheduler.submit(call, now)

    def _admit(self, call: Call) -> bool:
        """Resolve positions and reserve the call's slots, all or nothing; on any error
        reply it to this call alone (the object is as it was) and refuse it."""
        st: CallState = call.payload
        try:
            self._prepare(call.oid, st)
        except Exception as exc:
            self._error(st.identity, st.rid, self._errno(exc, f"call {st.rid}"))
            return False
        self.counters.tokens_reused += st.reused
        session = self.sessions.get(call.session)
        if session is not None:
            session.tokens_reused += st.reused
        self.counters.queue_wait_s += st.admitted_at - st.arrival
        self.counters.queue_hist.observe((st.admitted_at - st.arrival) * 1e3)
        return True

    def _prepare(self, oid: int, st: CallState) -> None:
        """Every check first (positions fit int32, the object stays within the context,
        quota), then the one change: reserve new slots, or reopen the last entry for a
        re-predict (`tokens=[]`, recomputed in place)."""
        obj = self.store.get(oid)
        st.base = obj.length
        if st.tokens:
            if st.positions is None:
                first = self.store.last_position(obj) + 1
                st.positions = list(range(first, first + len(st.tokens)))
            grow = len(st.tokens)
        else:
            if obj.length == 0:
                raise ProtocolError("EINVAL", "no tokens and an empty cache: nothing to "
                                    "predict from")
            tokens, positions = self.store.entries(oid, obj.length - 1)
            st.tokens, st.positions = tokens.tolist(), positions.tolist()
            grow = 0
        # A generate appends max_tokens - 1 more entries after its prompt.
        last = st.positions[-1] + max(st.max_tokens - 1, 0)
        if last >= MAX_POSITION:
            raise ProtocolError("EOVERFLOW", f"positions would reach {last}: past the "
                                f"largest position {MAX_POSITION - 1}")
        if obj.length + grow > self.limits.context:
            raise ProtocolError("E2BIG", f"the object would hold {obj.length + grow} entries, "
                                f"more than the context of {self.limits.context}")
        if grow:
            self.quotas.check(oid, self.store.pages_needed(oid, grow))
            self.store.reserve(oid, grow)
        else:
            self.quotas.check(oid, self.store.reopen_pages(oid))
            st.reopened = self.store.reopen_last(oid)
        st.reused = self.store.get(oid).length
        st.admitted_at = time.monotonic()

    def _errno(self, exc: Exception, what: str) -> ProtocolError:
        """The error a request gets for `exc`: its own errno, or EIO (logged) for a bug."""
        if isinstance(exc, ProtocolError):
            return exc
        self.log(f"{what} failed: {''.join(traceback.format_exception(exc))}")
        return ProtocolError("EIO", f"internal error: {type(exc).__name__}: {exc}")

    def _fail(self, call: Call, exc: Exception) -> None:
        """Fail one call alone: it leaves the queue with its error, and its object is put
        back as it was."""
        st: CallState = call.payload
        self.scheduler.remove(call)
        error = self._errno(exc, f"call {st.rid}")
        try:
            self._undo(call)
        finally:
            self._error(st.identity, st.rid, error)

    def _undo(self, call: Call) -> None:
        """Put the object of an admitted call that will not complete back exactly as it
        was before the call: reservation released, nothing the call computed kept.
        Never raises (a failure here is a bug: logged, and fsck will show it)."""
        st: CallState = call.payload
        obj = self.store.objects.get(call.oid)
        if obj is None or not call.admitted:   # never admitted: it changed nothing
            return
        try:
            if st.reopened is not None and obj.length < st.base:
                self.store.restore_last(call.oid, *st.reopened)
            self.store.release_reservation(call.oid)
            if obj.length > st.base:
                self.store.truncate(call.oid, st.base)
        except Exception as exc:
            self.log(f"undoing call {st.rid}: {''.join(traceback.format_exception(exc))}")

    def step(self) -> bool:
        """Run one batch if any call is ready; whether one ran."""
        plan = self.scheduler.schedule(self._admit)
        if not plan.items:
            self.replay_deferred(time.monotonic())
            return False
        settled: set[int] = set()
        try:
            self._run(plan, settled)
        except Exception as exc:   # a bug in the step's bookkeeping: fail what is unsettled
            self.log(f"step failed: {traceback.format_exc()}")
            for item in plan.items:
                if item.call.cid in settled:     # answered: just out of the queue
                    self.scheduler.remove(item.call)
                    continue
                settled.add(item.call.cid)
                self._fail(item.call, exc)
        self.replay_deferred(time.monotonic())
        return True

    def _run(self, plan: Plan, settled: set[int]) -> None:
        """Execute a plan. A call that fails (building its chunk, in the forward pass,
        picking its token) fails alone; `settled` collects the calls answered for good."""
        items, chunks = [], []
        for item in plan.items:
            try:
                chunks.append(self._chunk(item))
                items.append(item)
            except Exception as exc:
                settled.add(item.call.cid)
                self._fail(item.call, exc)
        started = time.monotonic()
        results = self._execute(chunks)
        elapsed = time.monotonic() - started
        ran: list[PlanItem] = []
        for item, chunk, out in zip(items, chunks, results):
            call, st = item.call, item.call.payload
            if isinstance(out, Exception):
                settled.add(call.cid)
                self._fail(call, out)
                continue
            st.step_s += elapsed
            if len(out):
                st.logits.append(out)
            if item.completes:   # the call's known tokens are all computed: commit them
                done = item.start + item.count
                self.store.commit(call.oid, np.asarray(st.tokens[st.committed:done], np.int32),
                                  np.asarray(st.positions[st.committed:done], np.int32))
                st.committed = done
            ran.append(item)
        self._pick_greedy([i.call.payload for i in ran if i.completes])
        finished: set[int] = set()
        failed: set[int] = set()
        for item in ran:
            if item.completes:
                try:
                    if self._finish_chunk(item.call, item.call.payload):
                        finished.add(item.call.cid)
                except Exception as exc:
                    failed.add(item.call.cid)
                    self._fail(item.call, exc)
        settled |= finished | failed
        ran = [i for i in ran if i.call.cid not in failed]
        c = self.counters
        c.steps += 1
        c.calls += len(ran)
        c.tokens_computed += sum(i.count for i in ran)
        for item in ran:
            session = self.sessions.get(item.call.session)
            if session is not None:
                session.tokens_computed += item.count
        c.step_s += elapsed
        c.step_hist.observe(elapsed * 1e3)
        self.scheduler.update(Plan(ran), finished, time.monotonic(), elapsed)

    def _chunk(self, item: PlanItem) -> Chunk:
        """The runner's view of one call's chunk: it attends to the object's entries, the
        call's earlier (not yet committed) tokens and itself."""
        st: CallState = item.call.payload
        tokens, positions, wanted = st.chunk(item.start, item.count)
        obj = self.store.get(item.call.oid)
        kv_len = obj.length + item.start + item.count - st.committed
        return Chunk(tokens, positions, self.store.page_table(obj, kv_len), kv_len, wanted)

    def _execute(self, chunks: list[Chunk]) -> list[torch.Tensor | Exception]:
        """runner.execute, isolating failures: if the batch raises, its halves run
        again (bisection) until each failing chunk stands alone with its exception. The
        failed pass wrote only into the calls' own reserved slots, which the retry
        rewrites (or the failed call's undo releases)."""
        if not chunks:
            return []
        try:
            results = list(self.runner.execute(chunks))
            if len(results) != len(chunks):
                raise RuntimeError(f"runner returned {len(results)} results for "
                                   f"{len(chunks)} chunks")
            return results
        except Exception as exc:
            if len(chunks) == 1:
                return [exc]
            self.log(f"a batch of {len(chunks)} failed ({type(exc).__name__}: {exc}); "
                     "retrying it in halves")
            mid = len(chunks) // 2
            return self._execute(chunks[:mid]) + self._execute(chunks[mid:])

    @staticmethod
    def _pick_greedy(states: list[CallState]) -> None:
        """The next token of every greedy, unmasked generate in one batched op (the
        same argmax and logprob `sampling.sample` gives, without 32 small calls). If it
        fails, each call picks its own token in `next_token`."""
        greedy = [st for st in states if st.op == "generate" and st.allowed is None
                  and (st.sample is None or st.sample.temperature < sampling.MIN_TEMPERATURE)]
        if not greedy:
            return
        try:
            rows = torch.cat([st.logits[-1] for st in greedy])          # [k, V]
            logprobs = torch.log_softmax(rows, dim=-1)
            tokens = torch.argmax(rows, dim=-1)
            picked = logprobs.gather(1, tokens[:, None])[:, 0]
        except Exception:
            return
        for st, token, lp in zip(greedy, tokens.tolist(), picked.tolist()):
            st.logits.pop()
            st.picked = (token, lp)

    def _finish_chunk(self, call: Call, st: CallState) -> bool:
        """A call's known tokens are computed; reply, or extend a generate. Done?"""
        obj = self.store.get(call.oid)
        cost = st.cost(call.total, len(obj.pages))
        if st.op == "pred":
            head, frames = st.pred_reply(cost)
            self.send(st.identity, head, frames)
            return True
        token, logprob = st.next_token()
        st.generated.append(token)
        st.logprobs.append(logprob)
        reason = None
        if token in st.stop:
            reason = "stop"
        elif st.stop_text and st.hits_stop_text(self.tokenizer.decode):
            reason = "stop"
        elif len(st.generated) >= st.max_tokens:
            reason = "length"
        elif obj.length + 1 > self.limits.context:
            reason = "length"          # the object is full: no room for the token
        if reason is None:
            try:
                self.quotas.check(call.oid, self.store.pages_needed(call.oid, 1))
                self.store.reserve(call.oid, 1)
            except ProtocolError as exc:
                reason = exc.code
        if reason is None:
            if st.stream:
                self.send(st.identity, ok_reply(st.rid, more=True, tokens=[token],
                                                logprobs=[logprob]), [])
            st.tokens.append(token)
            st.positions.append(st.positions[-1] + 1)
            call.total += 1
            return False
        # The one terminal message: a stream's last token comes with the outcome.
        final = {"finish_reason": reason, "cost": cost, "more": False,
                 "tokens": [token] if st.stream else st.generated,
                 "logprobs": [logprob] if st.stream else st.logprobs,
                 "generated": len(st.generated)}
        if st.stream:
            final["final"] = True
        self.send(st.identity, ok_reply(st.rid, **final), [])
        return True
