"""The KV-object system calls: create, fork, grant, free, stat, tokens, truncate,
extract, merge, export, import.

A mixin of the engine: it works on the engine's `store` (objects and pages), `caps`
(who may reach them), `quotas` and `runner.cache` (page size in bytes). Every new
object gets its first capability through `_new_object`, which charges it to the
calling session and undoes the object on EDQUOT. Read-only requests here are answered
from committed entries even while a call on the object is queued (see engine.py).
"""
from __future__ import annotations

from liblip import protocol as p
from liblip.protocol import ProtocolError
from predd.sessions import Session


class KVOps:
    def _issue(self, oid: int, rights: str, s: Session, persist: bool) -> dict:
        cap = self.caps.issue(oid, p.check_rights(rights), None if persist else s.sid)
        return {"cap": cap.token, "rights": cap.rights, **self._stat(oid)}

    def _new_object(self, oid: int, s: Session, persist: bool, rights: str = "rw") -> dict:
        """Issue the first capability of a fresh object, charged to `s` (EDQUOT undoes)."""
        p.check_rights(rights)
        self.quotas.charge(oid, s, persist)
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
                "last_position": self.store.last_position(obj), "model": self.runner.cfg.name}

    def op_kv_create(self, s, r: p.KvCreate, extra, now) -> dict:
        return self._new_object(self.store.create().oid, s, r.persist)

    def op_kv_fork(self, s, r: p.KvFork, extra, now) -> dict:
        src = self._cap(r.cap)
        p.check_rights(r.rights)
        return self._new_object(self.store.fork(src.oid).oid, s, r.persist, r.rights)

    def op_kv_grant(self, s, r: p.KvGrant, extra, now) -> dict:
        src = self._cap(r.cap)
        if p.check_rights(r.rights) == "rw" and not src.writable:
            raise ProtocolError("EACCES", "cannot grant rw from a read-only capability")
        return self._issue(src.oid, r.rights, s, r.persist)

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
        cap = self._cap(r.cap)
        obj = self.store.extract(cap.oid, r.ranges, max_length=self.limits.context)
        return self._new_object(obj.oid, s, r.persist)

    def op_kv_merge(self, s, r: p.KvMerge, extra, now) -> dict:
        if not r.caps:
            raise ProtocolError("EINVAL", "kv_merge needs at least one capability")
        self.limits.count("kv_merge.caps", r.caps, self.limits.merge_caps)
        oids = [self._cap(t).oid for t in r.caps]
        obj = self.store.merge(oids, max_length=self.limits.context)
        return self._new_object(obj.oid, s, r.persist)

    def op_kv_export(self, s, r: p.KvExport, extra, now):
        cap = self._cap(r.cap)
        blob = self.store.export(cap.oid)
        return {"bytes": len(blob), **self._stat(cap.oid)}, [blob]

    def op_kv_import(self, s, r: p.KvImport, extra, now) -> dict:
        if len(extra) != 1:
            raise ProtocolError("EINVAL", "kv_import needs exactly one binary frame")
        obj = self.store.import_(extra[0], self.vocab, self.limits.context)
        return self._new_object(obj.oid, s, r.persist)
