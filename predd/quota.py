"""Quotas: the KV pages each session and each uid may hold (EDQUOT beyond).

Every object is charged to the session that made it (created, forked, extracted,
merged or imported it) and to that session's uid, for as many pages as its page list
holds (shared pages count for every holder, as `du` counts them). Objects made with a
persistent capability (kvfsd's named caches) outlive sessions and are charged to the uid
only. uid 0 is exempt from the uid quota, as root is from disk quotas. A limit of 0
means none. The uid is the one the client declared in `hello`.
"""
from __future__ import annotations

from dataclasses import dataclass

from liblip.protocol import ProtocolError
from predd.kvstore import KVStore
from predd.sessions import Session


@dataclass(frozen=True)
class QuotaConfig:
    session_pages: int = 0
    uid_pages: int = 0

    @property
    def enabled(self) -> bool:
        return bool(self.session_pages or self.uid_pages)


class Quotas:
    def __init__(self, config: QuotaConfig, store: KVStore) -> None:
        self.config = config
        self.store = store
        self.owner: dict[int, tuple[int | None, int]] = {}   # oid -> (session, uid)

    def charge(self, oid: int, session: Session, persist: bool) -> None:
        self.owner[oid] = (None if persist else session.sid, session.uid)

    def forget(self, oid: int) -> None:
        self.owner.pop(oid, None)

    def _usage(self, index: int, who: int) -> int:
        return sum(len(self.store.objects[oid].pages) for oid, o in self.owner.items()
                   if o[index] == who and oid in self.store.objects)

    def check(self, oid: int, extra_pages: int = 0) -> None:
        """EDQUOT if the owners of `oid` would hold too many pages with `extra_pages` more."""
        if not self.config.enabled or oid not in self.owner:
            return
        session, uid = self.owner[oid]
        limit = self.config.session_pages
        if limit and session is not None and self._usage(0, session) + extra_pages > limit:
            raise ProtocolError("EDQUOT", f"session {session} would hold more than "
                                f"{limit} KV pages")
        limit = self.config.uid_pages
        if limit and uid > 0 and self._usage(1, uid) + extra_pages > limit:
            raise ProtocolError("EDQUOT", f"uid {uid} would hold more than {limit} KV pages")
