"""Capabilities: unguessable 128-bit handles to KV objects, each with rights.

Lifetime rules:
* A capability belongs to the session that obtained it, or to no session when it was
  made `persist` (kvfsd's names, which must outlive kvfsd's own session).
* An object lives while at least one capability refers to it; revoking the last one
  frees the object (POSIX: the last close of an unlinked file).
* Ending a session revokes its capabilities; persistent ones are revoked only by name.
* Capability strings are secrets: never log them (use `short`).
"""
from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from liblip.protocol import CAP_HEX_LEN, ProtocolError


@dataclass
class Capability:
    token: str
    oid: int
    rights: str
    session: int | None   # None: persistent

    @property
    def writable(self) -> bool:
        return self.rights == "rw"


def short(token: str) -> str:
    """A loggable stand-in for a capability."""
    return f"cap:{token[:4]}…"


class Capabilities:
    def __init__(self, free_object: Callable[[int], None]) -> None:
        self._caps: dict[str, Capability] = {}
        self._per_object: dict[int, int] = {}
        self._free_object = free_object

    def __len__(self) -> int:
        return len(self._caps)

    def issue(self, oid: int, rights: str, session: int | None) -> Capability:
        cap = Capability(secrets.token_hex(CAP_HEX_LEN // 2), oid, rights, session)
        self._caps[cap.token] = cap
        self._per_object[oid] = self._per_object.get(oid, 0) + 1
        return cap

    def lookup(self, token: str, write: bool = False) -> Capability:
        cap = self._caps.get(token) if isinstance(token, str) else None
        if cap is None:
            raise ProtocolError("EBADF", "no such capability (forged, revoked or expired)")
        if write and not cap.writable:
            raise ProtocolError("EACCES", "capability is read-only")
        return cap

    def revoke(self, token: str) -> None:
        cap = self._caps.pop(token)
        left = self._per_object[cap.oid] - 1
        if left:
            self._per_object[cap.oid] = left
        else:
            del self._per_object[cap.oid]
            self._free_object(cap.oid)

    def revoke_session(self, session: int) -> int:
        """Revoke every capability of a session; how many there were."""
        tokens = [t for t, c in self._caps.items() if c.session == session]
        for token in tokens:
            self.revoke(token)
        return len(tokens)

    def of_session(self, session: int) -> list[Capability]:
        return [c for c in self._caps.values() if c.session == session]

    def objects(self) -> set[int]:
        return set(self._per_object)
