"""Quotas and limits: what each uid and each session may hold and do.

Charging rules:
* Every object is charged to one uid, and to the session that made it unless it was
  made `persist` (kvfsd's named caches outlive sessions: uid only). The uid is the
  maker's kernel uid, or the `owner` a trusted peer named (kvfsd names the uid of the
  FUSE caller, so a file's cache is charged to the user who made it).
* An object's charge is its whole page list (shared pages count for every holder, as
  `du` counts them). The KV store reports every change of a page list (`resized`), so
  the counters are kept incrementally and every check is O(1); `verify` recomputes
  them from scratch (fsck, so every test's teardown checks them).
* The daemon's own uid (the operator, and kvfsd: kernel-verified now) is exempt from the
  uid limits, as root is from disk quotas; session limits apply to every session.
  A page or object limit of 0 means none.
Limits beyond pages, checked by the engine: objects (EDQUOT), calls in flight and the
request rate (EAGAIN), capabilities per session (EMFILE), sessions per uid (EAGAIN).
"""
from __future__ import annotations

from dataclasses import dataclass

from symphony_protocol import ProtocolError


@dataclass(frozen=True)
class QuotaConfig:
    session_pages: int = 0            # 0: no limit
    uid_pages: int | None = None      # None: half the pool; 0: no limit
    session_objects: int = 1024
    uid_objects: int = 4096
    session_calls: int = 256          # pred/generate calls (and held requests) in flight
    uid_calls: int = 1024
    session_caps: int = 4096
    uid_sessions: int = 256
    rate: float = 2000.0              # requests per second per session (token bucket)
    burst: float = 4000.0

    def uid_page_limit(self, pool_pages: int) -> int:
        return pool_pages // 2 if self.uid_pages is None else self.uid_pages


@dataclass
class Charge:
    session: int | None   # None: persistent, charged to the uid only
    uid: int
    pages: int            # pages charged so far: len(object.pages)


def add_count(counter: dict[int, int], key: int, n: int) -> None:
    """counter[key] += n, the key gone at 0 (a count per uid or session)."""
    left = counter.get(key, 0) + n
    if left:
        counter[key] = left
    else:
        counter.pop(key, None)


class Quotas:
    def __init__(self, config: QuotaConfig, pool_pages: int, exempt_uid: int) -> None:
        self.config = config
        self.uid_pages = config.uid_page_limit(pool_pages)
        self.exempt_uid = exempt_uid
        self.charges: dict[int, Charge] = {}
        self.pages_of_uid: dict[int, int] = {}
        self.pages_of_session: dict[int, int] = {}
        self.objects_of_uid: dict[int, int] = {}
        self.objects_of_session: dict[int, int] = {}

    # ------------------------------------------------------------ charging

    def charge(self, oid: int, pages: int, session: int | None, uid: int) -> None:
        """Charge a new object holding `pages` pages to `session` (None: uid only)
        and `uid`."""
        assert oid not in self.charges, f"object {oid} charged twice"
        self.charges[oid] = Charge(session, uid, 0)
        add_count(self.objects_of_uid, uid, 1)
        if session is not None:
            add_count(self.objects_of_session, session, 1)
        self.resized(oid, pages)

    def resized(self, oid: int, delta: int) -> None:
        """The KV store's report: object `oid`'s page list grew by `delta` (may be < 0).
        Objects not (or no longer) charged are ignored: they are being made or freed."""
        charge = self.charges.get(oid)
        if charge is None or delta == 0:
            return
        charge.pages += delta
        add_count(self.pages_of_uid, charge.uid, delta)
        if charge.session is not None:
            add_count(self.pages_of_session, charge.session, delta)

    def forget(self, oid: int) -> None:
        """Uncharge an object (it is being freed)."""
        if oid not in self.charges:
            return
        self.resized(oid, -self.charges[oid].pages)
        charge = self.charges.pop(oid)
        add_count(self.objects_of_uid, charge.uid, -1)
        if charge.session is not None:
            add_count(self.objects_of_session, charge.session, -1)

    # ------------------------------------------------------------ checking

    def check(self, oid: int, extra_pages: int = 0) -> None:
        """EDQUOT if the owners of `oid` would hold too many pages with `extra_pages`
        more, or too many objects. O(1)."""
        charge = self.charges.get(oid)
        if charge is None:
            return
        c = self.config
        session, uid = charge.session, charge.uid
        if session is not None:
            if c.session_pages and self.pages_of_session.get(session, 0) + extra_pages > \
                    c.session_pages:
                raise ProtocolError("EDQUOT", f"session {session} would hold more than "
                                    f"{c.session_pages} KV pages")
            if c.session_objects and self.objects_of_session.get(session, 0) > \
                    c.session_objects:
                raise ProtocolError("EDQUOT", f"session {session} would hold more than "
                                    f"{c.session_objects} KV objects")
        if uid == self.exempt_uid:
            return
        if self.uid_pages and self.pages_of_uid.get(uid, 0) + extra_pages > self.uid_pages:
            raise ProtocolError("EDQUOT", f"uid {uid} would hold more than "
                                f"{self.uid_pages} KV pages")
        if c.uid_objects and self.objects_of_uid.get(uid, 0) > c.uid_objects:
            raise ProtocolError("EDQUOT", f"uid {uid} would hold more than "
                                f"{c.uid_objects} KV objects")

    def usage(self, uid: int) -> dict:
        limit = 0 if uid == self.exempt_uid else self.uid_pages
        objects = 0 if uid == self.exempt_uid else self.config.uid_objects
        return {"uid": uid, "pages": self.pages_of_uid.get(uid, 0), "page_limit": limit,
                "objects": self.objects_of_uid.get(uid, 0), "object_limit": objects}

    # ------------------------------------------------------------ integrity

    def verify(self, objects: dict) -> list[str]:
        """Problems found recomputing every counter from the objects' page lists
        (`objects`: oid -> KVObject)."""
        problems = []
        pages_uid: dict[int, int] = {}
        pages_session: dict[int, int] = {}
        objects_uid: dict[int, int] = {}
        objects_session: dict[int, int] = {}
        for oid in objects.keys() - self.charges.keys():
            problems.append(f"object {oid} is charged to nobody")
        for oid in self.charges.keys() - objects.keys():
            problems.append(f"charge for missing object {oid}")
        for oid, charge in self.charges.items():
            obj = objects.get(oid)
            if obj is not None and len(obj.pages) != charge.pages:
                problems.append(f"object {oid}: {len(obj.pages)} pages, "
                                f"{charge.pages} charged")
            add_count(pages_uid, charge.uid, charge.pages)
            add_count(objects_uid, charge.uid, 1)
            if charge.session is not None:
                add_count(pages_session, charge.session, charge.pages)
                add_count(objects_session, charge.session, 1)
        for name, want, have in (("pages per uid", pages_uid, self.pages_of_uid),
                                 ("pages per session", pages_session, self.pages_of_session),
                                 ("objects per uid", objects_uid, self.objects_of_uid),
                                 ("objects per session", objects_session,
                                  self.objects_of_session)):
            if want != have:
                problems.append(f"quota counters of {name} are {have}, recounted {want}")
        return problems


def check_limit(used: int, limit: int, code: str, what: str) -> None:
    """`code` when one more would pass `limit` (0: none)."""
    if limit and used >= limit:
        raise ProtocolError(code, f"{what}: limit {limit} reached")
