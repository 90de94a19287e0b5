"""Sessions: one per connected client (ZeroMQ routing identity), kept alive by a lease.

A session starts with `hello` (or implicitly with its first request) and ends with
`bye`, or when nothing has arrived for `lease_s` seconds. The engine revokes an ended
session's capabilities, which frees its anonymous objects: a killed LIP leaks nothing.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field


@dataclass
class Session:
    sid: int
    identity: bytes
    lease_s: float
    last_seen: float
    client: str = ""
    pid: int = 0
    uid: int = -1
    calls: int = 0
    started: float = field(default=0.0)

    def expired(self, now: float) -> bool:
        return now - self.last_seen > self.lease_s


class Sessions:
    def __init__(self, default_lease_s: float) -> None:
        self.default_lease_s = default_lease_s
        self._by_identity: dict[bytes, Session] = {}
        self._by_sid: dict[int, Session] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_sid)

    def __iter__(self):
        return iter(list(self._by_sid.values()))

    def touch(self, identity: bytes, now: float) -> Session:
        """The session of `identity`, opened if new; its lease restarts."""
        session = self._by_identity.get(identity)
        if session is None:
            session = Session(next(self._ids), identity, self.default_lease_s, now, started=now)
            self._by_identity[identity] = session
            self._by_sid[session.sid] = session
        session.last_seen = now
        return session

    def of_identity(self, identity: bytes) -> Session | None:
        return self._by_identity.get(identity)

    def get(self, sid: int) -> Session | None:
        return self._by_sid.get(sid)

    def end(self, sid: int) -> None:
        session = self._by_sid.pop(sid, None)
        if session is not None:
            self._by_identity.pop(session.identity, None)

    def expired(self, now: float) -> list[Session]:
        return [s for s in self._by_sid.values() if s.expired(now)]
