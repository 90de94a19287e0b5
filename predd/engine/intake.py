"""The engine's door: one raw message in, and either a reply out or a call queued.

`Intake` is the part of `Engine` (predd/engine/core.py) that meets requests: it decodes a
message, finds or opens the caller's session (identity from `Peer`, never from the
request: predd/server/identity.py), checks the request rate and sessions per uid, and
hands the request to its handler (predd/server/handlers, given to the engine by the
server) — or holds it behind a busy object (predd/engine/deferred.py) and replays it
when that object's calls are done. It also ends sessions, frees objects whose last
capability went, and checks the whole state (`fsck`).

Ordering rule: requests that change an object (pred, generate, kv_truncate, kv_free)
are applied in arrival order: a call waits in the scheduler, and a change on an object
with queued calls (or earlier held changes) is held and replayed when they are done.
Requests that only read an object (stat, tokens, fork, grant, extract, merge, export)
answer at once from its committed entries — a snapshot — so `ls` or `cp` on a cache
never waits for a long generation on it.

Failure rule: any exception of one request becomes an errno reply to that request alone
(EIO for a bug, logged); the daemon goes on.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from typing import Any

import symphony_protocol as p
from symphony_protocol import ErrorReply, ProtocolError
from predd.engine import calls, sampling
from predd.engine.calls import Call
from predd.engine.config import EngineConfig
from predd.engine.deferred import Deferred, Held
from predd.engine.metrics import Counters
from predd.engine.scheduler import Scheduler
from predd.engine.speculation import Speculation
from predd.memory.kvstore import KVStore
from predd.memory.policy import Memory
from predd.memory.pool import Pool
from predd.server.capabilities import Capabilities
from predd.server.identity import Peer, identify
from predd.server.quotas import Quotas, check_limit
from predd.server.sessions import Session, Sessions
from predd.worker.runner import Runner

Send = Callable[[bytes, dict, list[bytes]], None]
# handler(engine, session, request, extra frames, now) -> reply, or None for a queued call
Handler = Callable[[Any, Session, p.Request, list[bytes], float], "p.Reply | None"]
CHANGES = (p.Pred, p.Generate, p.KvTruncate, p.KvFree)   # wait behind a busy object
QUEUED = (p.Pred, p.Generate)                            # become calls
QUICK_BYTES = 1024   # a pred that takes its speculation is far shorter: longer ones wait
                     # for the step's end undecoded (a pass in flight is not held up)


class Intake:
    """Requests in, replies out. The engine's parts it uses are declared here; `Engine`
    makes them."""

    config: EngineConfig
    send: Send
    log: Callable[[str], None]
    handlers: Mapping[type[p.Request], Handler]
    counters: Counters
    sessions: Sessions
    scheduler: Scheduler
    speculation: Speculation
    deferred: Deferred
    caps: Capabilities
    store: KVStore
    pool: Pool
    quotas: Quotas
    memory: Memory
    runner: Runner
    flying: Any                 # the step between Engine.launch and Engine.land, if any

    @property
    def max_message_bytes(self) -> int:
        """The largest request worth receiving: a kv_import of the most pages one uid
        may hold (its tokens and positions included), plus slack for the header."""
        pages = self.quotas.uid_pages or self.pool.num_pages
        return pages * (self.runner.cache.bytes_per_page + 10 * self.pool.page_size) + 2**20

    # ------------------------------------------------------------ requests

    def handle(self, identity: bytes, frames: list[bytes], now: float, peer: Peer) -> None:
        """Answer one raw message from `peer` (or queue it); never raises. The server
        counts the time its turns of messages take (`counters.time_s["requests"]`)."""
        self.counters.requests += 1
        rid = None
        try:
            header, extra = p.decode_frames(frames)
            rid = header.get("rid") if isinstance(header.get("rid"), int) else None
            if self.flying is not None:    # the server hands them to handle_in_flight then
                raise RuntimeError("a request handled while a step's pass runs")
            session = self.sessions.of_identity(identity)
            if session is not None:
                self._arrived(session, peer, now)
            spec = (self._speculation_of(session, header)
                    if session is not None and not extra else None)
            if spec is not None:
                self._take_speculation(identity, session, header, spec)
                return
            request = p.decode_request(header)
            if session is None:
                session = self._open_session(identity, peer, request, now)
            self._dispatch(identity, session, request, extra, now)
        except Exception as exc:
            self._refuse(identity, rid, exc)

    def handle_in_flight(self, identity: bytes, frames: list[bytes], now: float,
                         peer: Peer) -> bool:
        """While a step's pass runs (Engine.launch .. Engine.land): answer the message as
        `handle` would where it is a pred of an open session that takes its object's
        speculation at the door (`_take_speculation`: a change of labels, or a computed
        speculation answered and committed, on an object the pass does not touch), and
        say so. Anything else is left as it was, for after the step (False): no state
        changes, nothing counted."""
        session = self.sessions.of_identity(identity)
        if (session is None or len(frames) != 1 or len(frames[0]) > QUICK_BYTES
                or peer.address != session.peer):
            return False
        try:
            header, _ = p.decode_frames(frames)
            spec = self._speculation_of(session, header)
        except ProtocolError:          # the full path answers it
            return False
        except Exception as exc:       # a bug: the full path, after the step, answers it
            self.log(f"internal error looking at a request in flight: "
                     f"{type(exc).__name__}: {exc}")
            return False
        if spec is None:
            return False
        self.counters.requests += 1
        self.counters.answered_in_flight += 1
        try:
            self._arrived(session, peer, now)
            self._take_speculation(identity, session, header, spec)
        except Exception as exc:
            self._refuse(identity, header["rid"], exc)
        return True

    def _refuse(self, identity: bytes, rid: int | None, exc: Exception) -> None:
        """A request's error reply: its own errno (EAGAIN counted), or EIO for a bug
        (logged: it must not take the daemon down)."""
        if isinstance(exc, ProtocolError):
            if exc.code == "EAGAIN":
                self.counters.throttled += 1
            self._reply(identity, rid, ErrorReply.of(exc))
            return
        self.log(f"internal error on request {rid}: {type(exc).__name__}: {exc}")
        self._reply(identity, rid, ErrorReply(code="EIO", message=f"internal error: {exc}"))

    def _arrived(self, session: Session, peer: Peer, now: float) -> None:
        """A message of `session` from `peer`: its credentials checked, its lease renewed,
        its rate counted (EPERM, EAGAIN)."""
        if peer.address != session.peer:
            raise ProtocolError("EPERM", "this connection's credentials are not "
                                "those of the session it names")
        session.last_seen = now
        if not session.allow(now, self.config.quota.rate, self.config.quota.burst):
            raise ProtocolError("EAGAIN", f"more than {self.config.quota.rate:g} "
                                "requests per second: slow down")

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
        spec = self.speculation
        spec.settle(session.sid, req, oids)   # what is left there, the pred may take
        busy = [o for o in oids if (self.scheduler.busy(o) and o not in spec.by_oid)
                or self.deferred.holds(o)]
        if busy and isinstance(req, CHANGES):   # wait behind the first busy object
            self._check_calls(session)
            self.deferred.hold(busy[0], session, Held(identity, req, extra))
            return
        if isinstance(req, QUEUED):
            self._check_calls(session)
        handler = self.handlers[type(req)]
        try:
            reply = handler(self, session, req, extra, now)
        except ProtocolError as exc:    # never refused for a speculation's page
            if not spec.make_room(exc.code):
                raise
            reply = handler(self, session, req, extra, now)
        if reply is not None:
            self._reply(identity, req.rid, reply)

    def _speculation_of(self, session: Session, header: dict) -> Call | None:
        """The speculation the raw map `header` takes at the door as the full path would
        give it to it (Speculation.taken_by says when); None: the full path decides (it
        says why, or holds the request). Changes nothing."""
        if not self.speculation.by_oid or header.get("op") != "pred":
            return None
        cap = self.caps.find(header.get("cap"))
        if cap is None or not cap.writable or self.deferred.holds(cap.oid):
            return None
        return self.speculation.taken_by(session.sid, cap.oid, header)

    def _take_speculation(self, identity: bytes, session: Session, header: dict,
                          spec: Call) -> None:
        """The pred map `header` takes `spec` (`_speculation_of`), without a request
        record or a call made for it: answered at once where it was computed, else when
        its step has run. Errors are the full path's."""
        self.speculation.measure(spec.oid, header["tokens"])
        self._check_calls(session)
        into, buffer = header.get("into", -1), session.logits
        if into != -1 and buffer is not None:
            buffer.check_slot(into)
        rid = header["rid"]
        self.speculation.take(spec, identity, rid, sampling.make_generator(spec.sample),
                              buffer, into if buffer is not None else -1)
        if spec.parked:
            self._reply(identity, rid, self.claimed(spec))

    def _objects_of(self, req: p.Request) -> list[int]:
        tokens = [req.cap] if hasattr(req, "cap") else list(getattr(req, "caps", []))
        return [self.caps.lookup(t).oid for t in tokens]

    def _check_calls(self, s: Session) -> None:
        """EAGAIN when `s` or its uid has as many calls in flight as allowed."""
        q = self.config.quota
        mine = self.speculation.of_session(s.sid)    # speculations are not the caller's
        check_limit(self.scheduler.queued(session=s.sid) - mine + s.deferred,
                    q.session_calls, "EAGAIN", f"calls in flight of session {s.sid}")
        if not s.trusted:
            check_limit(self.scheduler.queued(uid=s.uid) - self.speculation.of_uid(s.uid)
                        + self.deferred.of_uid.get(s.uid, 0),
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
            if call.speculative:
                self.speculation.gone(call)
        dropped = [c for c in dropped if not c.speculative]
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
            if call.speculative:
                self.speculation.gone(call)
            else:
                self._reply(call.identity, call.rid, freed)
        for held in self.deferred.take(oid):
            session = self.sessions.of_identity(held.identity)
            if session is not None:
                self.deferred.release(session)
            self._reply(held.identity, held.request.rid, freed)
        self.scheduler.forget(oid)
        self.speculation.forget(oid)
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
        problems += self.speculation.check()
        problems += self.deferred.check(self.sessions)
        problems += self.memory.check()
        held = sum(c.promised for c in self.scheduler.all_calls())
        if held != self.pool.held:
            problems.append(f"{self.pool.held} pages held back, calls promised {held}")
        return problems

    # ------------------------------------------------------------ a call's failure

    def _undo(self, call: Call) -> None:
        """calls.undo, which never fails: a failure here is a bug (logged; fsck shows it)."""
        try:
            calls.undo(call, self.store)
        except Exception as exc:
            self.log(f"undoing call {call.rid}: {''.join(traceback.format_exception(exc))}")

    def _fail(self, call: Call, exc: Exception) -> None:
        """Fail one call alone: it leaves the queue with its error, and its object is put
        back as it was."""
        self.scheduler.remove(call)
        if call.speculative:      # no client: it is gone, its object as it was
            self._undo(call)
            self.speculation.gone(call)
            return
        error = self._errno(exc, f"call {call.rid}")
        try:
            self._undo(call)
        finally:
            self._reply(call.identity, call.rid, error)
