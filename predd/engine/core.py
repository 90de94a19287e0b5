"""The engine: requests in, replies out; one step = schedule -> run -> commit -> reply.

Everything here runs on one thread (the server loop), so there are no locks. A request
goes to its handler (predd/handlers, keyed by request record); pred and generate
handlers queue a Call (predd/engine/calls.py) that the steps compute.

Ordering rule: requests that change an object (pred, generate, kv_truncate, kv_free)
are applied in arrival order: a call waits in the scheduler, and a change on an object
with queued calls (or earlier held changes) is held (predd/engine/deferred.py) and replayed
when they are done. Requests that only read an object (stat, tokens, fork, grant,
extract, merge, export) answer at once from its committed entries — a snapshot — so
`ls` or `cp` on a cache never waits for a long generation on it.

Identity rule: a request's session, uid and trust come from `Peer` (the kernel's
credentials on ipc, a token on authenticated tcp), never from the request itself; see
predd/server/identity.py. Limits (quota.py) are checked here at the door: the request rate and
sessions per uid when a message arrives, calls in flight when one is queued.

Failure rule: any exception of one request or one call becomes an errno reply to that
request alone (EIO for a bug, logged); a failed call's object is put back as it was.
"""
from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import symphony_protocol as p
from symphony_protocol import ErrorReply, ProtocolError
from predd.engine import calls
from predd.engine import outputs
from predd.engine.calls import Call
from predd.server.caps import Capabilities
from predd.engine.deferred import Deferred, Held
from predd.server.handlers import HANDLERS
from predd.server.identity import AuthKeys, Peer, identify
from predd.memory.kvstore import KVStore
from predd.server.limits import Limits
from predd.memory.policy import Memory, MemoryConfig, NoRoom
from predd.engine.metrics import Counters
from predd.memory.pool import Pool
from predd.server.quota import QuotaConfig, Quotas, check_limit
from predd.worker.tp import RankLost
from predd.worker.runner import Chunk, Runner
from predd.engine.scheduler import Plan, PlanItem, Scheduler, SchedulerConfig
from predd.server.sessions import Session, Sessions
from predd.memory.tiers import TierStore
from predd.model.tokenizer import Tokenizer

Send = Callable[[bytes, dict, list[bytes]], None]
CHANGES = (p.Pred, p.Generate, p.KvTruncate, p.KvFree)   # wait behind a busy object
QUEUED = (p.Pred, p.Generate)                            # become calls


@dataclass(frozen=True)
class EngineConfig:
    lease_s: float = 10.0
    scheduler: SchedulerConfig = SchedulerConfig()
    quota: QuotaConfig = QuotaConfig()
    limits: Limits = Limits()
    trusted_uid: int = field(default_factory=os.geteuid)   # predd's own: kvfsd, the operator
    auth: AuthKeys | None = None                             # tcp tokens (--auth-keys)
    memory: MemoryConfig = MemoryConfig()                     # tiers, pins, admission


class Engine:
    def __init__(self, runner: Runner, tokenizer: Tokenizer, config: EngineConfig,
                 send: Send, log: Callable[[str], None] = lambda msg: None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.send = send
        self.log = log
        m = config.memory
        self.pool = Pool(runner.config.kv_pages, runner.config.page_size, m.host_pages,
                         m.disk_pages)
        self.quotas = Quotas(config.quota, sum(self.pool.capacity), config.trusted_uid)
        self.tiers = TierStore(self.pool, runner.cache, m.swap_dir)
        self.store = KVStore(self.pool, self.tiers, on_resize=self.quotas.resized)
        self.caps = Capabilities(self._free_object)
        self.sessions = Sessions(config.lease_s)
        self.scheduler = Scheduler(config.scheduler, on_leave=self._left)
        self.memory = Memory(m, self.store, self.tiers, self.scheduler.admitted,
                             lambda oid: self.quotas.charges[oid].uid)
        self.deferred = Deferred()
        self.counters = Counters()
        self.vocab: int = runner.model_config.vocab_size
        self.limits: Limits = config.limits.resolved(runner.model_config.max_position)
        self.started = time.monotonic()

    @property
    def max_message_bytes(self) -> int:
        """The largest request worth receiving: a kv_import of the most pages one uid
        may hold (its tokens and positions included), plus slack for the header."""
        pages = self.quotas.uid_pages or self.pool.num_pages
        return pages * (self.runner.cache.bytes_per_page + 10 * self.pool.page_size) + 2**20

    # ------------------------------------------------------------ requests

    def handle(self, identity: bytes, frames: list[bytes], now: float, peer: Peer) -> None:
        """Answer one raw message from `peer` (or queue it); never raises."""
        started = time.perf_counter()
        try:
            self._handle(identity, frames, now, peer)
        finally:
            self.counters.time_s["requests"] += time.perf_counter() - started

    def _handle(self, identity: bytes, frames: list[bytes], now: float, peer: Peer) -> None:
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
            self._reply(identity, rid, ErrorReply.of(exc))
        except Exception as exc:  # a bug must not take the daemon down
            self.log(f"internal error on request {rid}: {type(exc).__name__}: {exc}")
            self._reply(identity, rid, ErrorReply(code="EIO", message=f"internal error: {exc}"))

    def _reply(self, identity: bytes, rid: int | None, reply: p.Reply) -> None:
        if not reply.ok:
            self.counters.errors += 1
        self.send(identity, reply.wire(rid), reply.frames())

    def _errno(self, exc: Exception, what: str) -> ErrorReply:
        """The reply a request gets for `exc`: its own errno, or EIO (logged) for a bug."""
        if isinstance(exc, ProtocolError):
            return ErrorReply.of(exc)
        self.log(f"{what} failed: {''.join(traceback.format_exception(exc))}")
        return ErrorReply(code="EIO", message=f"internal error: {type(exc).__name__}: {exc}")

    def _dispatch(self, identity: bytes, session: Session, req: p.Request,
                  extra: list[bytes], now: float) -> None:
        oids = self._objects_of(req)   # EBADF for a bad capability, before anything else
        busy = [o for o in oids if self.scheduler.busy(o) or self.deferred.holds(o)]
        if busy and isinstance(req, CHANGES):   # wait behind the first busy object
            self._check_calls(session)
            self.deferred.hold(busy[0], session, Held(identity, req, extra))
            return
        if isinstance(req, QUEUED):
            self._check_calls(session)
        reply = HANDLERS[type(req)](self, session, req, extra, now)
        if reply is not None:
            self._reply(identity, req.rid, reply)

    def _objects_of(self, req: p.Request) -> list[int]:
        tokens = [req.cap] if hasattr(req, "cap") else list(getattr(req, "caps", []))
        return [self.caps.lookup(t).oid for t in tokens]

    def _check_calls(self, s: Session) -> None:
        """EAGAIN when `s` or its uid has as many calls in flight as allowed."""
        q = self.config.quota
        check_limit(self.scheduler.queued(session=s.sid) + s.deferred, q.session_calls,
                    "EAGAIN", f"calls in flight of session {s.sid}")
        if not s.trusted:
            check_limit(self.scheduler.queued(uid=s.uid) + self.deferred.of_uid.get(s.uid, 0),
                        q.uid_calls, "EAGAIN", f"calls in flight of uid {s.uid}")

    def replay_deferred(self, now: float) -> None:
        """Replay the held requests of every object that has no queued call left."""
        for oid in self.deferred.oids():
            if self.scheduler.busy(oid):
                continue
            queue = self.deferred.take(oid)
            while queue:
                held = queue.pop(0)
                session = self.sessions.of_identity(held.identity)
                if session is None:
                    continue
                self.deferred.release(session)
                try:
                    self._dispatch(held.identity, session, held.request, held.extra, now)
                except Exception as exc:   # this request's error alone, never the loop's
                    self._reply(held.identity, held.request.rid,
                                self._errno(exc, f"request {held.request.rid}"))
                if self.scheduler.busy(oid):
                    self.deferred.put_back(oid, queue)
                    break

    # ------------------------------------------------------------ sessions and objects

    def _open_session(self, identity: bytes, peer: Peer, request: p.Request,
                      now: float) -> Session:
        """A session for a routing identity's first request, bound to `peer`."""
        c = self.config
        token = request.token if isinstance(request, p.Hello) else None
        uid, pid, via = identify(peer, token, c.auth)
        trusted = ((via == "kernel" and uid == c.trusted_uid)
                   or (via == "token" and c.auth is not None and c.auth.trusts(token)))
        if not trusted:
            check_limit(self.sessions.count(uid), c.quota.uid_sessions, "EAGAIN",
                        f"sessions of uid {uid}")
        session = self.sessions.open(identity, now, uid=uid, via=via, peer=peer.address,
                                     pid=pid, trusted=trusted, burst=c.quota.burst)
        session.allow(now, c.quota.rate, c.quota.burst)   # the opening request counts
        return session

    def end_session(self, s: Session, why: str) -> None:
        dropped = self.scheduler.cancel(lambda c: c.session == s.sid)
        for call in dropped:
            self._undo(call)
        self.deferred.drop_session(s)
        freed = self.caps.revoke_session(s.sid)
        self.sessions.end(s.sid)
        self.log(f"session {s.sid} ({s.client or 'anonymous'} pid {s.pid}) ended ({why}): "
                 f"{freed} capabilities revoked, {len(dropped)} calls dropped")

    def expire_sessions(self, now: float) -> None:
        for s in self.sessions.expired(now):
            self.end_session(s, "lease expired")

    def _free_object(self, oid: int) -> None:
        """The last capability of `oid` is gone: its waiting calls and held requests get
        EBADF, and its pages go back to the pool."""
        freed = ErrorReply(code="EBADF", message="KV object was freed")
        for call in self.scheduler.cancel(lambda c: c.oid == oid):
            self._reply(call.identity, call.rid, freed)
        for held in self.deferred.take(oid):
            session = self.sessions.of_identity(held.identity)
            if session is not None:
                self.deferred.release(session)
            self._reply(held.identity, held.request.rid, freed)
        self.scheduler.forget(oid)
        self.quotas.forget(oid)
        self.memory.forget(oid)
        self.store.free(oid)

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
        problems += self.deferred.check(self.sessions)
        problems += self.memory.check()
        held = sum(c.promised for c in self.scheduler.all_calls())
        if held != self.pool.held:
            problems.append(f"{self.pool.held} pages held back, calls promised {held}")
        return problems

    # ------------------------------------------------------------ calls

    def _admit(self, call: Call) -> bool | None:
        """Reserve what the call needs, all or nothing. With no room on the device yet
        it waits (None: asked again next step) up to `admit_wait_s` from its arrival;
        then, or on any other error, reply it to this call alone (the object is as it
        was) and refuse it."""
        try:
            calls.admit(call, self.store, self.quotas, self.limits, self.memory)
        except NoRoom as exc:
            waited = time.monotonic() - call.arrival
            if not exc.permanent and waited < self.config.memory.admit_wait_s:
                if not call.waited:
                    call.waited = True
                    self.counters.admission_waits += 1
                return None
            self._reply(call.identity, call.rid, ErrorReply.of(exc))
            return False
        except Exception as exc:
            self._reply(call.identity, call.rid, self._errno(exc, f"call {call.rid}"))
            return False
        self.counters.tokens_reused += call.reused
        session = self.sessions.of_sid(call.session)
        if session is not None:
            session.tokens_reused += call.reused
        waited = call.admitted_at - call.arrival
        self.counters.queue_wait_s += waited
        self.counters.queue_hist.observe(waited * 1e3)
        return True

    def _left(self, call: Call) -> None:
        """A call left the queue (done, failed, dropped): its unused promise is free."""
        self.memory.draw(call.promised)
        call.promised = 0

    def _fail(self, call: Call, exc: Exception) -> None:
        """Fail one call alone: it leaves the queue with its error, and its object is put
        back as it was."""
        self.scheduler.remove(call)
        error = self._errno(exc, f"call {call.rid}")
        try:
            self._undo(call)
        finally:
            self._reply(call.identity, call.rid, error)

    def _undo(self, call: Call) -> None:
        """calls.undo, which never fails: a failure here is a bug (logged; fsck shows it)."""
        try:
            calls.undo(call, self.store)
        except Exception as exc:
            self.log(f"undoing call {call.rid}: {''.join(traceback.format_exception(exc))}")

    # ------------------------------------------------------------ the step

    def step(self) -> bool:
        """Run one batch if any call is ready; whether one ran."""
        started = time.perf_counter()
        plan = self.scheduler.schedule(self._admit)
        self.counters.time_s["schedule"] += time.perf_counter() - started
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
        """Run a plan, commit what completed, reply. A call that fails (building its
        chunk, in the forward pass, picking its token) fails alone; `settled` collects
        the calls answered for good."""
        times = self.counters.time_s
        prepared = time.perf_counter()
        items, chunks = self._chunks(plan.items, settled)
        started = time.monotonic()
        times["prepare"] += time.perf_counter() - prepared
        results = self._execute(chunks)
        elapsed = time.monotonic() - started
        times["forward"] += elapsed
        finishing = time.perf_counter()
        ran: list[PlanItem] = []
        for item, out in zip(items, results):
            call = item.call
            if isinstance(out, Exception):
                settled.add(call.cid)
                self._fail(call, out)
                continue
            call.step_s += elapsed
            if len(out):
                call.logits.append(out)
            if item.completes:   # the call's known tokens are all computed
                calls.commit(call, self.store, item.start + item.count)
            ran.append(item)
        outputs.pick_greedy([i.call for i in ran if i.completes])
        finished: set[int] = set()
        failed: set[int] = set()
        for item in ran:
            if item.completes:
                try:
                    if self._reply_done(item.call):
                        finished.add(item.call.cid)
                except Exception as exc:
                    failed.add(item.call.cid)
                    self._fail(item.call, exc)
        settled |= finished | failed
        ran = [i for i in ran if i.call.cid not in failed]
        self._count_step(ran, elapsed)
        self.scheduler.update(Plan(ran), finished, time.monotonic(), elapsed)
        times["outputs"] += time.perf_counter() - finishing

    def _chunks(self, plan: list[PlanItem], settled: set[int]
                ) -> tuple[list[PlanItem], list[Chunk]]:
        """The runner's view of each call's chunk: it attends to the object's entries,
        the call's earlier (not yet committed) tokens and itself. The page tables come
        from one lookup for the step; a call whose chunk cannot be made fails alone
        (into `settled`)."""
        items, parts = [], []
        for item in plan:
            try:
                call = item.call
                tokens, positions, wanted = call.chunk(item.start, item.count)
                obj = self.store.get(call.oid)
                kv_len = obj.length + item.start + item.count - call.committed
                parts.append((tokens, positions, obj, kv_len, wanted))
                items.append(item)
            except Exception as exc:
                settled.add(item.call.cid)
                self._fail(item.call, exc)
        try:
            tables = self.store.page_tables([(obj, kv_len) for _, _, obj, kv_len, _ in parts])
        except Exception:       # one call's table is wrong: find it, the others go on
            tables = []
            for item, (_, _, obj, kv_len, _) in zip(items, parts):
                try:
                    tables.append(self.store.page_tables([(obj, kv_len)])[0])
                except Exception as exc:
                    settled.add(item.call.cid)
                    self._fail(item.call, exc)
                    tables.append(None)
        chunks = [Chunk(tokens, positions, table, kv_len, wanted) for
                  (tokens, positions, _, kv_len, wanted), table in zip(parts, tables)
                  if table is not None]
        return [item for item, table in zip(items, tables) if table is not None], chunks

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
        except RankLost:
            raise                  # not this batch's fault: predd cannot go on
        except Exception as exc:
            if len(chunks) == 1:
                return [exc]
            self.log(f"a batch of {len(chunks)} failed ({type(exc).__name__}: {exc}); "
                     "retrying it in halves")
            mid = len(chunks) // 2
            return self._execute(chunks[:mid]) + self._execute(chunks[mid:])

    def _reply_done(self, call: Call) -> bool:
        """A call's known tokens are computed: reply, or feed a generate's next token
        back (streaming it). Whether the call is done; a generate's done reply is its one
        terminal message, carrying its last token, finish_reason and cost."""
        obj = self.store.get(call.oid)
        pages = len(obj.pages)         # the cost's (made only for a reply that carries it)
        if not call.generating:
            reply = outputs.pred_reply(call, call.cost(pages))
            if isinstance(reply, p.PredLogits):
                self.counters.logits_rows["buffer" if reply.slot >= 0 else "frame"] += \
                    reply.shape[0]
            self._reply(call.identity, call.rid, reply)
            return True
        token, logprob = outputs.next_token(call)
        call.generated.append(token)
        call.logprobs.append(logprob)
        reason = outputs.stop_reason(call, token, self.tokenizer.decode,
                                     full=obj.length + 1 > self.limits.context)
        if reason is None:
            reason = calls.extend(call, token, self.store, self.quotas, self.memory)
        if reason is None:
            if call.stream:
                self._reply(call.identity, call.rid,
                            p.GenerateChunk(tokens=[token], logprobs=[logprob]))
            return False
        last = slice(-1, None) if call.stream else slice(None)
        self._reply(call.identity, call.rid, p.GenerateReply(
            tokens=call.generated[last], logprobs=call.logprobs[last],
            generated=len(call.generated), finish_reason=reason, cost=call.cost(pages)))
        return True

    def _count_step(self, ran: list[PlanItem], elapsed: float) -> None:
        c = self.counters
        c.steps += 1
        c.calls += len(ran)
        c.tokens_computed += sum(i.count for i in ran)
        for item in ran:
            session = self.sessions.of_sid(item.call.session)
            if session is not None:
                session.tokens_computed += item.count
        c.step_s += elapsed
        c.step_hist.observe(elapsed * 1e3)
