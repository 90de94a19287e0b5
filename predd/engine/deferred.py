"""Requests held behind a busy object, replayed in arrival order when it is idle.

Ordering rule: a request that changes an object (pred, generate, kv_truncate, kv_free)
while the object has queued calls or earlier held requests waits here, keyed on that
object; the engine replays an object's queue once the scheduler has nothing of it left,
and stops replaying when a replayed call makes it busy again. Reads never wait here.

Counting rule: a held request counts as a call in flight of its session
(`Session.deferred`) and uid (`of_uid`) from `hold` until `release` (it is replayed,
dropped with its session, or failed with its object); `check` recounts.
"""
from __future__ import annotations

from dataclasses import dataclass

import symphony_protocol as p
from predd.server.sessions import Session, Sessions


@dataclass
class Held:
    identity: bytes            # the client to reply to
    request: p.Request
    extra: list[bytes]         # the request's binary frames


class Deferred:
    def __init__(self) -> None:
        self._queues: dict[int, list[Held]] = {}   # oid -> held requests, arrival order
        self.of_uid: dict[int, int] = {}

    def holds(self, oid: int) -> bool:
        return bool(self._queues.get(oid))

    def oids(self) -> list[int]:
        return list(self._queues)

    def hold(self, oid: int, session: Session, held: Held) -> None:
        self._queues.setdefault(oid, []).append(held)
        self.release(session, -1)

    def release(self, session: Session, n: int = 1) -> None:
        """Stop counting `n` of `session`'s held requests (a negative n counts more)."""
        session.deferred -= n
        left = self.of_uid.get(session.uid, 0) - n
        if left:
            self.of_uid[session.uid] = left
        else:
            self.of_uid.pop(session.uid, None)

    def take(self, oid: int) -> list[Held]:
        """An object's held requests, out of the queue but still counted."""
        return self._queues.pop(oid, [])

    def put_back(self, oid: int, held: list[Held]) -> None:
        """Requests taken and not replayed: back at the front, ahead of any held since."""
        if held:
            self._queues.setdefault(oid, [])[:0] = held

    def remove(self, session: Session, rid: int,
               kinds: tuple[type[p.Request], ...]) -> Held | None:
        """Take `session`'s held request `rid` of one of `kinds` out (no longer
        counted), if held."""
        for oid, queue in self._queues.items():
            for i, h in enumerate(queue):
                if (h.identity == session.identity and h.request.rid == rid
                        and isinstance(h.request, kinds)):
                    del queue[i]
                    if not queue:
                        del self._queues[oid]
                    self.release(session)
                    return h
        return None

    def drop_session(self, session: Session) -> None:
        """Forget an ending session's held requests."""
        for oid, queue in list(self._queues.items()):
            queue[:] = [h for h in queue if h.identity != session.identity]
            if not queue:
                del self._queues[oid]
        self.release(session, session.deferred)

    def check(self, sessions: Sessions) -> list[str]:
        held: dict[int | None, int] = {}
        for queue in self._queues.values():
            for h in queue:
                x = sessions.of_identity(h.identity)
                uid = x.uid if x is not None else None
                held[uid] = held.get(uid, 0) + 1
        if held != self.of_uid:
            return [f"held requests per uid counted {self.of_uid}, found {held}"]
        return []
