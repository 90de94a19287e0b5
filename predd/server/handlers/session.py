"""Session and server ops: hello, bye, ping, info, stats, ps, fsck.

Identity rule: `hello` only checks what a client declares (uid, token) against what the
session already is (the kernel's or the token's uid: predd/server/identity.py); it never
changes the uid. `ps` shows a caller its own uid's sessions, a trusted caller all.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import symphony_protocol as p
from symphony_protocol import ProtocolError
from predd.server.logits_buffer import LogitsBuffer

if TYPE_CHECKING:
    from predd.engine.core import Engine
    from predd.server.sessions import Session


def hello(e: Engine, s: Session, r: p.Hello, extra: list[bytes], now: float) -> p.HelloReply:
    if not 0 < r.lease_s < 1e6:
        raise ProtocolError("EINVAL", "lease_s must be a positive number of seconds")
    if r.uid != -1 and r.uid != s.uid:
        source = {"kernel": "the kernel (SO_PEERCRED)", "token": "its token"}.get(
            s.via, "an unauthenticated tcp endpoint (nobody)")
        raise ProtocolError("EPERM", f"hello declares uid {r.uid}, but this session "
                            f"is uid {s.uid} by {source}; the uid is never the client's "
                            "to choose")
    if r.token and s.via == "token" and e.config.auth.uid_of(r.token) != s.uid:
        raise ProtocolError("EPERM", f"hello: the token names another uid than this "
                            f"session's ({s.uid})")
    if s.via != "kernel":
        s.pid = r.pid           # only for ps: the kernel cannot tell
    s.client, s.lease_s = r.client, r.lease_s
    refused = _attach_logits(e, s, r) if r.logits_fd != -1 else ""
    return p.HelloReply(session=s.sid, version=p.PROTOCOL_VERSION, lease_s=s.lease_s,
                        model=e.runner.model_config.name, uid=s.uid, trusted=s.trusted,
                        logits_slot_bytes=s.logits.slot_bytes if s.logits else 0,
                        logits_buffer=refused)


def _attach_logits(e: Engine, s: Session, r: p.Hello) -> str:
    """Take hello's logits buffer (a second hello replaces the first); why not, else ""."""
    if s.logits is not None:
        s.logits.close()
        s.logits = None
    try:
        s.logits = LogitsBuffer.attach(s.pid if s.via == "kernel" else 0, r.logits_fd,
                                       r.logits_slots, e.vocab, s.uid, exempt=s.trusted)
    except ProtocolError as exc:
        return f"{exc.code}: {exc.message}"
    return ""


def bye(e: Engine, s: Session, r: p.Bye, extra: list[bytes], now: float) -> p.EmptyReply:
    e.end_session(s, "bye")
    return p.EmptyReply()


def ping(e: Engine, s: Session, r: p.Ping, extra: list[bytes], now: float) -> p.EmptyReply:
    return p.EmptyReply()


def info(e: Engine, s: Session, r: p.Info, extra: list[bytes], now: float) -> p.InfoReply:
    model, run = e.runner.model_config, e.runner.config
    return p.InfoReply(
        model=model.name, vocab_size=model.vocab_size, eos_ids=list(e.tokenizer.eos_ids),
        bos_id=e.tokenizer.bos_id, page_size=e.pool.page_size,
        pages_total=e.pool.num_pages, pages_free=e.pool.free_pages,
        bytes_per_page=e.runner.cache.bytes_per_page, max_position=model.max_position,
        device=run.device, dtype=run.dtype, dtype_reason=run.dtype_reason,
        attention=e.runner.backend.name, num_layers=model.num_layers,
        version=p.PROTOCOL_VERSION, max_message_bytes=e.max_message_bytes,
        host_pages=e.pool.capacity[1], disk_pages=e.pool.capacity[2],
        linear=e.runner.linear, linear_reason=e.runner.linear_reason,
        cuda_graphs=e.runner.graphs is not None, cuda_graphs_reason=e.runner.graphs_reason,
        layer_loop=e.runner.layer_loop is not None,
        layer_loop_reason=e.runner.layer_loop_reason or "",
        cascade=e.runner.cascade_reason is None, cascade_reason=e.runner.cascade_reason or "",
        kv_dtype=str(e.runner.kv_dtype).removeprefix("torch."),
        kv_dtype_reason=e.runner.kv_dtype_reason)


def stats(e: Engine, s: Session, r: p.Stats, extra: list[bytes], now: float) -> p.StatsReply:
    c = e.counters
    return p.StatsReply(
        pages_total=e.pool.num_pages, pages_free=e.pool.free_pages,
        pages_used=e.pool.used_pages, objects=len(e.store.objects),
        capabilities=len(e.caps), sessions=len(e.sessions), steps=c.steps, calls=c.calls,
        mean_batch=round(c.calls / c.steps, 3) if c.steps else 0.0,
        tokens_computed=c.tokens_computed, tokens_reused=c.tokens_reused,
        queue_wait_ms=round(c.queue_wait_s * 1e3, 3), step_ms=round(c.step_s * 1e3, 3),
        launch_wait_ms=round(e.scheduler.waited_s * 1e3, 3),
        pending_calls=e.scheduler.pending() - len(e.speculation),   # the callers' own
        requests=c.requests, errors=c.errors,
        throttled=c.throttled, capped_steps=e.scheduler.capped_steps,
        admission_waits=c.admission_waits, batch_picks_failed=c.batch_picks_failed,
        answered_in_flight=c.answered_in_flight,
        logits_rows=dict(c.logits_rows),
        tiers=e.memory.stats(),
        pages_moved_down=e.memory.moves.down, pages_moved_up=e.memory.moves.up,
        bytes_moved=e.memory.moves.bytes,
        time_ms={k: round(v * 1e3, 3) for k, v in c.time_s.items()},
        queue_wait_hist=c.queue_hist.wire(), step_hist=c.step_hist.wire(),
        uptime_s=round(time.monotonic() - e.started, 3), speculation=e.speculation.stats.wire())


def ps(e: Engine, s: Session, r: p.Ps, extra: list[bytes], now: float) -> p.PsReply:
    """Sessions of the caller's uid (every session for a trusted caller), and what each
    uid holds against its limits."""
    visible = list(e.sessions) if s.trusted else e.sessions.of_uid(s.uid)
    rows = [{"session": x.sid, "client": x.client, "pid": x.pid, "uid": x.uid,
             "via": x.via, "trusted": x.trusted,
             "transport": "stream" if x.identity[:1] == b"\x01" else "zmq",
             "objects": e.quotas.objects_of_session.get(x.sid, 0),
             "pages": e.quotas.pages_of_session.get(x.sid, 0),
             "capabilities": e.caps.count(x.sid),
             "calls": e.scheduler.queued(session=x.sid) - e.speculation.of_session(x.sid)
             + x.deferred,
             "tokens_computed": x.tokens_computed, "tokens_reused": x.tokens_reused,
             "idle_s": round(now - x.last_seen, 3)} for x in visible]
    ended = [{"session": x.sid, "pid": x.pid, "uid": x.uid,
              "tokens_computed": x.tokens_computed, "tokens_reused": x.tokens_reused}
             for x in e.sessions.ended if s.trusted or x.uid == s.uid]
    uids = sorted({x.uid for x in visible} | {s.uid})
    return p.PsReply(sessions=rows, ended=ended, uids=[
        {**e.quotas.usage(u), "sessions": e.sessions.count(u),
         "calls": e.scheduler.queued(uid=u) - e.speculation.of_uid(u)
         + e.deferred.of_uid.get(u, 0)}
        for u in uids])


def fsck(e: Engine, s: Session, r: p.Fsck, extra: list[bytes], now: float) -> p.FsckReply:
    problems = e.fsck()
    return p.FsckReply(clean=not problems, problems=problems, pages_total=e.pool.num_pages,
                       pages_free=e.pool.free_pages, objects=len(e.store.objects))


HANDLERS = {p.Hello: hello, p.Bye: bye, p.Ping: ping, p.Info: info, p.Stats: stats,
            p.Ps: ps, p.Fsck: fsck}
