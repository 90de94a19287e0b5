"""The KV-object system calls: create, fork, grant, free, stat, tokens, truncate,
extract, merge, export, import.

A mixin of the engine: it works on the engine's `store` (objects and pages), `caps`
(who may reach them), `quotas` and `runner.cache` (page size in bytes). Every new
object gets its first capability through `_new_object`, which charges it to the
calling session (or, `persist`, to no session) and a uid, and undoes the object on
EDQUOT. Read-only requests here are answered from committed entries even while a call
on the object is queued (see engine.py).

Trust rule: only a trusted session (an ipc peer running as predd's own uid: kvfsd) may
make a capability `persist` (outlive its session: no lease, no session quota) or name
an `owner` uid other than its own to charge; anyone else gets EPERM, before anything
is made.
"""
from __future__ import annotations

from liblip import protocol as p
from liblip.protocol import ProtocolError
from predd.caps import Capability
from predd.identity import MAX_UID
from predd.quota import check_limit
from predd.sessions import Session


class KVOps:
    def _may_issue(self, s: Session, persist: bool, owner: int | None = None) -> int:
        """Check that `s` may get a capability made `persist`, for an object charged to
        `owner`; the uid to charge. EPERM, EINVAL or EMFILE before anything is made."""
        if persist and not s.trusted:
            raise ProtocolError("EPERM", "persist: only a trusted peer (predd's own uid, "
                                "i.e. kvfsd) may make a capability outlive its session; "
                                "save a cache as a file instead")
        if not persist and not s.trusted:
            check_limit(self.caps.count(s.sid), self.config.quota.session_caps, "EMFILE",
                        f"capabilities of session {s.sid}")
        if owner is None:
            return s.uid
        if not 0 <= owner <= MAX_UID:
            raise ProtocolError("EINVAL", f"owner must be a uid in [0, {MAX_UID}]")
        if owner != s.uid and not s.trusted:
            raise ProtocolError("EPERM", f"owner: uid {s.uid} may not charge an object "
                                f"to uid {owner}")
        return owner

    def _issue(self, oid: int, rights: str, s: Session, persist: bool,
               parent: Capability | None = None) -> dict:
        cap = self.caps.issue(oid, p.check_rights(rights), None if persist else s.sid, parent)
        return {"cap": cap.token, "rights": cap.rights, **self._stat(oid)}

    def _new_object(self, oid: int, s: Session, persist: bool, uid: int,
                    rights: str = "rw") -> dict:
        """Issue the first capability of a fresh object, charged to `s` (none if
        `persist`) and `uid` (EDQUOT undoes the object)."""
        p.check_rights(rights)
        self.quotas.charge(oid, len(self.store.get(oid).pages), None if persist else s.sid,
                           uid)
        try:
            self.quotas.check(oid)
        except ProtocolError:
            self.quotas.forget(oid)
            self.store.free(oid)
            raise
        return self._issue(oid, rights, s, persist)

    def _stat(self, oid: int) -> dict:
        obj = self.store.get(oid)
        pages = len(obj.pages)
        return {"tokens": obj.length, "pages": pages,
                "bytes": pages * self.runner.cache.bytes_per_page,
                "last_position": self.store.last_position(obj), "model": self.runner.model_config.name}

    def op_kv_create(self, s, r: p.KvCreate, extra, now) -> dict:
        uid = self._may_issue(s, r.persist, r.owner)
        return self._new_object(self.store.create().oid, s, r.persist, uid)

    def op_kv_fork(self, s, r: p.KvFork, extra, now) -> dict:
        uid = self._may_issue(s, r.persist, r.owner)
        src = self._cap(r.cap)
        p.check_rights(r.rights)
        return self._new_object(self.store.fork(src.oid).oid, s, r.persist, uid, r.rights)

    def op_kv_grant(self, s, r: p.KvGrant, extra, now) -> dict:
        self._may_issue(s, r.persist)
        src = self._cap(r.cap)
        if p.check_rights(r.rights) == "rw" and not src.writable:
            raise ProtocolError("EACCES", "cannot grant rw from a read-only capability")
        return self._issue(src.oid, r.rights, s, r.persist, parent=src)

    def op_kv_free(self, s, r: p.KvFree, extra, now) -> dict:
        self._cap(r.cap)
        self.caps.revoke(r.cap)
        return {}

    def op_kv_stat(self, s, r: p.KvStat, extra, now) -> dict:
        cap = self._cap(r.cap)
        return {"rights": cap.rights, **self._stat(cap.oid)}

    def op_kv_tokens(self, s, r: p.KvTokens, extra, now) -> dict:
        cap = self._cap(r.cap)
        tokens, positions = self.store.entries(cap.oid, r.start, r.end)
        return {"tokens": tokens.tolist(), "positions": positions.tolist()}

    def op_kv_truncate(self, s, r: p.KvTruncate, extra, now) -> dict:
        cap = self._cap(r.cap, write=True)
        self.store.truncate(cap.oid, r.length)
        return self._stat(cap.oid)

    def op_kv_extract(self, s, r: p.KvExtract, extra, now) -> dict:
        self.limits.count("kv_extract.ranges", r.ranges, self.limits.extract_ranges)
        uid = self._may_issue(s, r.persist, r.owner)
        cap = self._cap(r.cap)
        obj = self.store.extract(cap.oid, r.ranges, max_length=self.limits.context)
        return self._new_object(obj.oid, s, r.persist, uid)

    def op_kv_merge(self, s, r: p.KvMerge, extra, now) -> dict:
        if not r.caps:
            raise ProtocolError("EINVAL", "kv_merge needs at least one capability")
        self.limits.count("kv_merge.caps", r.caps, self.limits.merge_caps)
        uid = self._may_issue(s, r.persist, r.owner)
        oids = [self._cap(t).oid for t in r.caps]
        obj = self.store.merge(oids, max_length=self.limits.context)
        return self._new_object(obj.oid, s, r.persist, uid)

    def op_kv_export(self, s, r: p.KvExport, extra, now):
        cap = self._cap(r.cap)
        blob = self.store.export(cap.oid)
        return {"bytes": len(blob), **self._stat(cap.oid)}, [blob]

    def op_kv_import(self, s, r: p.KvImport, extra, now) -> dict:
        if len(extra) != 1:
            raise ProtocolError("EINVAL", "kv_import needs exactly one binary frame")
        uid = self._may_issue(s, r.persist, r.owner)
        obj = self.store.import_(extra[0], self.vocab, self.limits.context)
        return self._new_object(obj.oid, s, r.persist, uid)
