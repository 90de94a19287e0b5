"""KV-object ops: create, fork, grant, free, stat, tokens, truncate, extract, merge,
export, import.

They work on the engine's `store` (objects and pages), `caps` (who may reach them) and
`quotas`. Every new object gets its first capability through `_new_object`, which
charges it to the calling session (or, `persist`, to no session) and a uid, and undoes
the object on EDQUOT. Read-only ops here are answered from committed entries even while
a call on the object is queued (see predd/engine/core.py).

Trust rule: only a trusted session (an ipc peer running as predd's own uid: kvfsd) may
make a capability `persist` (outlive its session: no lease, no session quota) or name
an `owner` uid other than its own to charge; anyone else gets EPERM, before anything
is made.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import symphony_protocol as p
from symphony_protocol import ProtocolError
from predd.server.capabilities import Capability
from predd.server.identity import MAX_UID
from predd.server.quotas import check_limit

if TYPE_CHECKING:
    from predd.engine.core import Engine
    from predd.server.sessions import Session


def _may_issue(e: Engine, s: Session, persist: bool, owner: int | None = None) -> int:
    """Check that `s` may get a capability made `persist`, for an object charged to
    `owner`; the uid to charge. EPERM, EINVAL or EMFILE before anything is made."""
    if persist and not s.trusted:
        raise ProtocolError("EPERM", "persist: only a trusted peer (predd's own uid, "
                            "i.e. kvfsd) may make a capability outlive its session; "
                            "save a cache as a file instead")
    if not persist and not s.trusted:
        check_limit(e.caps.count(s.sid), e.config.quota.session_caps, "EMFILE",
                    f"capabilities of session {s.sid}")
    if owner is None:
        return s.uid
    if not 0 <= owner <= MAX_UID:
        raise ProtocolError("EINVAL", f"owner must be a uid in [0, {MAX_UID}]")
    if owner != s.uid and not s.trusted:
        raise ProtocolError("EPERM", f"owner: uid {s.uid} may not charge an object "
                            f"to uid {owner}")
    return owner


def stat(e: Engine, oid: int, rights: str = "", cap: str = "") -> p.KvReply:
    obj = e.store.get(oid)
    pages = len(obj.pages)
    return p.KvReply(tokens=obj.length, pages=pages,
                     bytes=pages * e.runner.cache.bytes_per_page,
                     last_position=e.store.last_position(obj),
                     model=e.runner.model_config.name, tier=e.memory.tier_of(obj),
                     pinned=e.memory.is_pinned(obj),
                     idle_s=round(max(time.monotonic() - obj.last_used, 0.0), 3),
                     rights=rights, cap=cap)


def _issue(e: Engine, oid: int, rights: str, s: Session, persist: bool,
           parent: Capability | None = None) -> p.KvReply:
    cap = e.caps.issue(oid, p.check_rights(rights), None if persist else s.sid, parent)
    return stat(e, oid, rights=cap.rights, cap=cap.token)


def _new_object(e: Engine, oid: int, s: Session, persist: bool, uid: int,
                rights: str = "rw") -> p.KvReply:
    """Issue the first capability of a fresh object, charged to `s` (none if `persist`)
    and `uid` (EDQUOT undoes the object)."""
    p.check_rights(rights)
    e.quotas.charge(oid, len(e.store.get(oid).pages), None if persist else s.sid, uid)
    try:
        e.quotas.check(oid)
    except ProtocolError:
        e.quotas.forget(oid)
        e.store.free(oid)
        raise
    return _issue(e, oid, rights, s, persist)


def kv_create(e: Engine, s: Session, r: p.KvCreate, extra: list[bytes],
              now: float) -> p.KvReply:
    uid = _may_issue(e, s, r.persist, r.owner)
    return _new_object(e, e.store.create().oid, s, r.persist, uid)


def kv_fork(e: Engine, s: Session, r: p.KvFork, extra: list[bytes], now: float) -> p.KvReply:
    uid = _may_issue(e, s, r.persist, r.owner)
    src = e.caps.lookup(r.cap)
    p.check_rights(r.rights)
    e.memory.touch(e.store.get(src.oid))
    return _new_object(e, e.store.fork(src.oid).oid, s, r.persist, uid, r.rights)


def kv_grant(e: Engine, s: Session, r: p.KvGrant, extra: list[bytes],
             now: float) -> p.KvReply:
    _may_issue(e, s, r.persist)
    src = e.caps.lookup(r.cap)
    if p.check_rights(r.rights) == "rw" and not src.writable:
        raise ProtocolError("EACCES", "cannot grant rw from a read-only capability")
    return _issue(e, src.oid, r.rights, s, r.persist, parent=src)


def kv_free(e: Engine, s: Session, r: p.KvFree, extra: list[bytes],
            now: float) -> p.EmptyReply:
    e.caps.lookup(r.cap)
    e.caps.revoke(r.cap)
    return p.EmptyReply()


def kv_stat(e: Engine, s: Session, r: p.KvStat, extra: list[bytes], now: float) -> p.KvReply:
    cap = e.caps.lookup(r.cap)
    return stat(e, cap.oid, rights=cap.rights)


def kv_tokens(e: Engine, s: Session, r: p.KvTokens, extra: list[bytes],
              now: float) -> p.KvTokensReply:
    cap = e.caps.lookup(r.cap)
    tokens, positions = e.store.entries(cap.oid, r.start, r.end)
    return p.KvTokensReply(tokens=tokens.tolist(), positions=positions.tolist())


def kv_truncate(e: Engine, s: Session, r: p.KvTruncate, extra: list[bytes],
                now: float) -> p.KvReply:
    cap = e.caps.lookup(r.cap, write=True)
    e.store.truncate(cap.oid, r.length)
    return stat(e, cap.oid)


def kv_extract(e: Engine, s: Session, r: p.KvExtract, extra: list[bytes],
               now: float) -> p.KvReply:
    e.limits.count("kv_extract.ranges", r.ranges, e.limits.extract_ranges)
    uid = _may_issue(e, s, r.persist, r.owner)
    cap = e.caps.lookup(r.cap)
    obj = e.store.extract(cap.oid, r.ranges, max_length=e.limits.context)
    return _new_object(e, obj.oid, s, r.persist, uid)


def kv_merge(e: Engine, s: Session, r: p.KvMerge, extra: list[bytes],
             now: float) -> p.KvReply:
    if not r.caps:
        raise ProtocolError("EINVAL", "kv_merge needs at least one capability")
    e.limits.count("kv_merge.caps", r.caps, e.limits.merge_caps)
    uid = _may_issue(e, s, r.persist, r.owner)
    oids = [e.caps.lookup(t).oid for t in r.caps]
    obj = e.store.merge(oids, max_length=e.limits.context)
    return _new_object(e, obj.oid, s, r.persist, uid)


def kv_export(e: Engine, s: Session, r: p.KvExport, extra: list[bytes],
              now: float) -> p.KvExportReply:
    cap = e.caps.lookup(r.cap)
    e.memory.touch(e.store.get(cap.oid))
    blob = e.store.export(cap.oid)
    return p.KvExportReply(**stat(e, cap.oid).fields(), snapshot=blob)


def kv_import(e: Engine, s: Session, r: p.KvImport, extra: list[bytes],
              now: float) -> p.KvReply:
    if len(extra) != 1:
        raise ProtocolError("EINVAL", "kv_import needs exactly one binary frame")
    uid = _may_issue(e, s, r.persist, r.owner)
    obj = e.store.import_(extra[0], e.vocab, e.limits.context)
    return _new_object(e, obj.oid, s, r.persist, uid)


def kv_policy(e: Engine, s: Session, r: p.KvPolicy, extra: list[bytes],
              now: float) -> p.KvReply:
    """Pin, unpin or evict an object (rw: it changes where others' shared pages live
    too): predd/memory/policy.py."""
    cap = e.caps.lookup(r.cap, write=True)
    if r.pin is not None and r.evict:
        raise ProtocolError("EINVAL", "kv_policy: pin and evict together")
    obj = e.store.get(cap.oid)
    if r.pin is not None:
        e.memory.pin(obj, r.pin)
    if r.evict:
        e.memory.evict(obj)
    return stat(e, cap.oid)


def io_wait(e: Engine, s: Session, r: p.IoWait, extra: list[bytes],
            now: float) -> p.EmptyReply:
    e.limits.count("io_wait.caps", r.caps, e.limits.merge_caps)
    oids = {e.caps.lookup(token).oid for token in r.caps} if r.caps else \
        {cap.oid for cap in e.caps.of_session(s.sid)}
    e.memory.io_wait([e.store.get(oid) for oid in oids], r.on)
    return p.EmptyReply()


HANDLERS = {p.KvPolicy: kv_policy, p.IoWait: io_wait, p.KvCreate: kv_create, p.KvFork: kv_fork, p.KvGrant: kv_grant,
            p.KvFree: kv_free, p.KvStat: kv_stat, p.KvTokens: kv_tokens,
            p.KvTruncate: kv_truncate, p.KvExtract: kv_extract, p.KvMerge: kv_merge,
            p.KvExport: kv_export, p.KvImport: kv_import}
