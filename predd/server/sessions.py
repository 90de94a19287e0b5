"""Sessions: one per connected client (ZeroMQ routing identity), kept alive by a lease.

Lifetime and identity rules:
* A session is opened by the first request of a routing identity (on an authenticated
  tcp endpoint: only by a `hello` with a valid token) and ends with `bye`, or when
  nothing has arrived for `lease_s` seconds. The engine revokes an ended session's
  capabilities, which frees its anonymous objects: a killed LIP leaks nothing.
* A session is bound to the credentials of the frame that opened it (`peer`: on ipc
  "localhost:UID:GID:PID" from SO_PEERCRED). A later frame under the same routing
  identity with other credentials is refused (EPERM) and does not touch the session.
* `uid` is the kernel's (ipc), the token's (authenticated tcp) or nobody (loopback tcp
  without keys); `trusted` is set only for ipc peers running as predd's own euid.
* Each session has a request-rate token bucket (`allow`); trusted sessions have none.
* A session's logits buffer (predd/server/logits_buffer.py) is closed when it ends.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from predd.server.logits_buffer import LogitsBuffer

ENDED_KEPT = 1024   # ended sessions whose final figures `ps` still shows


@dataclass
class Session:
    sid: int
    identity: bytes
    lease_s: float
    last_seen: float
    uid: int = -1
    via: str = ""             # how uid is known: "kernel", "token" or "nobody"
    peer: str = ""            # the Peer-Address it is bound to
    pid: int = 0              # the kernel's (ipc) or, on tcp, what hello declared
    trusted: bool = False
    client: str = ""
    deferred: int = 0         # requests held behind a busy object (engine.deferred)
    started: float = field(default=0.0)
    bucket: float = 0.0       # request tokens left (rate limit)
    refilled: float = 0.0
    tokens_computed: int = 0  # what this session's calls cost (ps; kept a while after end)
    tokens_reused: int = 0
    logits: LogitsBuffer | None = None   # hello's logits_fd, once predd holds it

    def expired(self, now: float) -> bool:
        return now - self.last_seen > self.lease_s

    def allow(self, now: float, rate: float, burst: float) -> bool:
        """Take one request token; False when the bucket is empty (EAGAIN)."""
        if self.trusted or rate <= 0:
            return True
        self.bucket = min(burst, self.bucket + (now - self.refilled) * rate)
        self.refilled = now
        if self.bucket < 1.0:
            return False
        self.bucket -= 1.0
        return True


class Sessions:
    def __init__(self, default_lease_s: float) -> None:
        self.default_lease_s = default_lease_s
        self._by_identity: dict[bytes, Session] = {}
        self._by_sid: dict[int, Session] = {}
        self.ended: collections.deque[Session] = collections.deque(maxlen=ENDED_KEPT)
        self._per_uid: dict[int, dict[int, Session]] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._by_sid)

    def __iter__(self):
        return iter(list(self._by_sid.values()))

    def open(self, identity: bytes, now: float, uid: int = -1, via: str = "",
             peer: str = "", pid: int = 0, trusted: bool = False,
             burst: float = 0.0) -> Session:
        """A new session for `identity` (which has none), its request bucket full."""
        assert identity not in self._by_identity, "session already open"
        session = Session(next(self._ids), identity, self.default_lease_s, now, uid=uid,
                          via=via, peer=peer, pid=pid, trusted=trusted, started=now,
                          bucket=burst, refilled=now)
        self._by_identity[identity] = session
        self._by_sid[session.sid] = session
        self._per_uid.setdefault(uid, {})[session.sid] = session
        return session

    def of_identity(self, identity: bytes) -> Session | None:
        return self._by_identity.get(identity)

    def of_sid(self, sid: int) -> Session | None:
        return self._by_sid.get(sid)

    def of_uid(self, uid: int) -> list[Session]:
        return list(self._per_uid.get(uid, {}).values())

    def count(self, uid: int) -> int:
        """How many sessions `uid` has open."""
        return len(self._per_uid.get(uid, ()))

    def end(self, sid: int) -> None:
        session = self._by_sid.pop(sid, None)
        if session is not None:
            if session.logits is not None:
                session.logits.close()
                session.logits = None
            self.ended.append(session)   # its final figures stay visible to `ps` a while
            self._by_identity.pop(session.identity, None)
            mine = self._per_uid[session.uid]
            del mine[sid]
            if not mine:
                del self._per_uid[session.uid]

    def expired(self, now: float) -> list[Session]:
        return [s for s in self._by_sid.values() if s.expired(now)]
