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

import os
import time
import traceback

import torch
from collections.abc import Callable
from dataclasses import dataclass, field


from liblip import protocol as p
from liblip.protocol import ProtocolError, error_reply, ok_reply
from predd import sampling
from predd.calls import CallState
from predd.caps import Capabilities, Capability
from predd.identity import AuthKeys, Peer, identify
from predd.kvops import KVOps
from predd.kvstore import KVStore
from predd.pool import Pool
from predd.quota import QuotaConfig, Quotas, check_limit
from predd.runner import Chunk, Runner
from predd.scheduler import Call, Scheduler, SchedulerConfig
from predd.sessions import Session, Sessions
from predd.tokenizer import Tokenizer

Send = Callable[[bytes, dict, list[bytes]], None]
CHANGES = frozenset({"pred", "generate", "kv_truncate", "kv_free"})
QUEUED = frozenset({"pred", "generate"})
MAX_POSITION = 2**31 - 1


@dataclass(frozen=True)
class EngineConfig:
    lease_s: float = 10.0
    scheduler: SchedulerConfig = SchedulerConfig()
    quota: QuotaConfig = QuotaConfig()
    trusted_uid: int = field(default_factory=os.geteuid)   # predd's own: kvfsd, the operator
    auth: AuthKeys | None = None                             # tcp tokens (--auth-keys)


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
        self.vocab = runner.cfg.vocab_size
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
                except ProtocolError as exc:
                    self._error(identity, req.rid, exc)
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
                "model": self.runner.cfg.name, "uid": s.uid, "trusted": s.trusted}

    def op_bye(self, s: Session, r, extra, now) -> dict:
        self.end_session(s, "bye")
        return {}

    def op_ping(self, s, r, extra, now) -> dict:
        return {}

    def end_session(self, s: Session, why: str) -> None:
        dropped = self.scheduler.cancel(lambda c: c.session == s.sid)
        for call in dropped:
            self.store.release_reservation(call.oid)
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
        cfg = self.runner.cfg
        return {"model": cfg.name, "vocab_size": cfg.vocab_size,
                "eos_ids": list(self.tokenizer.eos_ids), "bos_id": self.tokenizer.bos_id,
                "page_size": self.pool.page_size, "pages_total": self.pool.num_pages,
                "pages_free": self.pool.free_pages,
                "bytes_per_page": self.runner.cache.bytes_per_page,
                "max_position": cfg.max_position, "device": self.runner.config.device,
                "dtype": self.runner.config.dtype, "attention": self.runner.backend.name,
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
                 "idle_s": round(now - x.last_seen, 3)} for x in visible]
        uids = sorted({x.uid for x in visible} | {s.uid})
        return {"sessions": rows, "uids": [
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
        return {"tokens": self.tokenizer.encode(r.text, add_special=r.add_special)}

    def op_detokenize(self, s, r: p.Detokenize, extra, now) -> dict:
        self._check_tokens(r.tokens)
        return {"text": self.tokenizer.decode(r.tokens, skip_special=r.skip_special)}

    def op_chat_template(self, s, r: p.ChatTemplate, extra, now) -> dict:
        for m in r.messages:
            if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ProtocolError("EINVAL", "messages: each needs str role and content")
        try:
            text = self.tokenizer.apply_chat_template(r.messages, r.add_generation_prompt)
        except Exception as exc:
            raise ProtocolError("EINVAL", f"chat template failed: {exc}") from None
        return {"text": text, "tokens": self.tokenizer.encode(text)}

    def _check_tokens(self, tokens: list[int]) -> None:
        if tokens and (min(tokens) < 0 or max(tokens) >= self.vocab):
            raise ProtocolError("EINVAL", f"token ids must be in [0, {self.vocab})")

    # ------------------------------------------------------------ pred / generate

    def op_pred(self, s: Session, r: p.Pred, extra, now) -> None:
        cap = self._cap(r.cap, write=True)
        n = len(r.tokens)
        self._check_tokens(r.tokens)
        if r.positions is not None and (len(r.positions) != n or any(
                not 0 <= q < MAX_POSITION for q in r.positions)):
            raise ProtocolError("EINVAL", f"positions: one per token, in [0, {MAX_POSITION})")
        if n == 0:   # re-predict from the last entry: it becomes the one token
            if r.outputs not in (None, [0], [-1]):
                raise ProtocolError("EINVAL", "with no tokens only output 0 exists")
            outputs = [0]
        else:
            outputs = [n - 1] if r.outputs is None else r.outputs
            if any(not -n <= o < n for o in outputs):
                raise ProtocolError("EINVAL", f"outputs must index the {n} tokens")
            outputs = [o % n for o in outputs]
        if r.topk < 0:
            raise ProtocolError("EINVAL", "topk must be >= 0")
        sample = p.SampleParams.from_wire(r.sample)
        state = CallState(s.identity, r.rid, "pred", list(r.tokens), r.positions, outputs,
                          sample, sampling.mask_tensor(r.mask, self.vocab), topk=r.topk,
                          generator=sampling.make_generator(sample), arrival=now)
        self._submit(s, cap.oid, state, now)

    def op_generate(self, s: Session, r: p.Generate, extra, now) -> None:
        cap = self._cap(r.cap, write=True)
        self._check_tokens(r.tokens)
        if r.max_tokens < 1:
            raise ProtocolError("EINVAL", "max_tokens must be >= 1")
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
        """Resolve positions and reserve the call's slots; reply ENOSPC if out of pages."""
        st: CallState = call.payload
        obj = self.store.get(call.oid)
        if not st.tokens:
            # Re-predict from the cache's last entry: recompute it in place.
            tokens, positions = self.store.entries(call.oid, obj.length - 1)
            self.store.truncate(call.oid, obj.length - 1)
            st.tokens, st.positions = tokens.tolist(), positions.tolist()
        if st.positions is None:
            first = self.store.last_position(obj) + 1
            st.positions = list(range(first, first + len(st.tokens)))
        st.reused = obj.length
        st.admitted_at = time.monotonic()
        try:
            self.quotas.check(call.oid, self.store.pages_needed(call.oid, len(st.tokens)))
            self.store.reserve(call.oid, len(st.tokens))
        except ProtocolError as exc:
            self._error(st.identity, st.rid, exc)
            return False
        self.counters.tokens_reused += st.reused
        self.counters.queue_wait_s += st.admitted_at - st.arrival
        return True

    def step(self) -> bool:
        """Run one batch if any call is ready; whether one ran."""
        plan = self.scheduler.schedule(self._admit)
        if not plan.items:
            self.replay_deferred(time.monotonic())
            return False
        try:
            self._run(plan)
        except Exception as exc:   # a bug in one step must not take the daemon down
            self.log(f"step failed: {traceback.format_exc()}")
            for item in plan.items:
                call, st = item.call, item.call.payload
                self.scheduler.remove(call)
                self.store.release_reservation(call.oid)
                self._error(st.identity, st.rid, ProtocolError("EIO", f"step failed: {exc}"))
        self.replay_deferred(time.monotonic())
        return True

    def _run(self, plan) -> None:
        chunks = []
        for item in plan.items:
            st: CallState = item.call.payload
            tokens, positions, wanted = st.chunk(item.start, item.count)
            obj = self.store.get(item.call.oid)
            ctx = self.store.slots(obj, 0, obj.length + item.count)
            chunks.append(Chunk(tokens, positions, ctx, wanted))
        started = time.monotonic()
        results = self.runner.execute(chunks)
        elapsed = time.monotonic() - started
        finished: set[int] = set()
        for item, chunk, logits in zip(plan.items, chunks, results):
            call, st = item.call, item.call.payload
            st.step_s += elapsed
            self.store.commit(call.oid, chunk.tokens, chunk.positions)
            if len(logits):
                st.logits.append(logits)
        self._pick_greedy([i.call.payload for i in plan.items if i.completes])
        for item in plan.items:
            if item.completes and self._finish_chunk(item.call, item.call.payload):
                finished.add(item.call.cid)
        c = self.counters
        c.steps += 1
        c.calls += len(plan.items)
        c.tokens_computed += plan.num_tokens
        c.step_s += elapsed
        self.scheduler.update(plan, finished, time.monotonic(), elapsed)

    @staticmethod
    def _pick_greedy(states: list[CallState]) -> None:
        """The next token of every greedy, unmasked generate in one batched op (the
        same argmax and logprob `sampling.sample` gives, without 32 small calls)."""
        greedy = [st for st in states if st.op == "generate" and st.allowed is None
                  and (st.sample is None or st.sample.temperature < sampling.MIN_TEMPERATURE)]
        if not greedy:
            return
        rows = torch.cat([st.logits.pop() for st in greedy])          # [k, V]
        logprobs = torch.log_softmax(rows, dim=-1)
        tokens = torch.argmax(rows, dim=-1)
        picked = logprobs.gather(1, tokens[:, None])[:, 0]
        for st, token, lp in zip(greedy, tokens.tolist(), picked.tolist()):
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
        elif st.stop_text and any(t in self.tokenizer.decode(st.generated) for t in st.stop_text):
            reason = "stop"
        elif len(st.generated) >= st.max_tokens:
            reason = "length"
        if reason is None:
            try:
                self.quotas.check(call.oid, self.store.pages_needed(call.oid, 1))
                self.store.reserve(call.oid, 1)
            except ProtocolError as exc:
                reason = exc.code
        if st.stream:
            self.send(st.identity, ok_reply(st.rid, more=reason is None, tokens=[token],
                                            logprobs=[logprob]), [])
        if reason is None:
            st.tokens.append(token)
            st.positions.append(st.positions[-1] + 1)
            call.total += 1
            return False
        final = {"finish_reason": reason, "cost": cost, "more": False,
                 "tokens": [] if st.stream else st.generated,
                 "logprobs": [] if st.stream else st.logprobs,
                 "generated": len(st.generated)}
        if st.stream:
            final["final"] = True
        self.send(st.identity, ok_reply(st.rid, **final), [])
        return True
