"""Capabilities: unguessable 128-bit handles to KV objects, each with rights.

Lifetime rules:
* A capability belongs to the session that obtained it, or to no session when it was
  made `persist` (kvfsd's names, which must outlive kvfsd's own session).
* An object lives while at least one capability refers to it; revoking the last one
  frees the object (POSIX: the last close of an unlinked file).
* Ending a session revokes its capabilities; persistent ones are revoked only by name.
* A grant made from a non-persistent capability is derived from it and dies with it:
  kvfsd's per-open grant ends at that open's release, and so does every grant a program
  made from it, so rights follow the file's mode after chmod/rm. Grants from a
  persistent capability (a file's name) are roots: an open outlives its file's unlink.
  Capabilities are indexed by session, so ending one costs O(its capabilities).
* Capability strings are secrets: never log them (use `short`).
"""
from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from symphony_protocol import CAP_HEX_LEN, ProtocolError


@dataclass
class Capability:
    token: str
    oid: int
    rights: str
    session: int | None   # None: persistent
    parent: str | None = None   # the capability it was granted from, if it dies with it

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
        self._per_session: dict[int, dict[str, None]] = {}   # insertion-ordered sets
        self._children: dict[str, dict[str, None]] = {}      # parent -> derived grants
        self._free_object = free_object

    def __len__(self) -> int:
        return len(self._caps)

    def issue(self, oid: int, rights: str, session: int | None,
              parent: Capability | None = None) -> Capability:
        """A new capability; granted from `parent`, it is derived (dies with it) unless
        either is persistent."""
        derived = (parent.token if parent is not None and parent.session is not None
                   and session is not None else None)
        cap = Capability(secrets.token_hex(CAP_HEX_LEN // 2), oid, rights, session, derived)
        self._caps[cap.token] = cap
        if derived is not None:
            self._children.setdefault(derived, {})[cap.token] = None
        self._per_object[oid] = self._per_object.get(oid, 0) + 1
        if session is not None:
            self._per_session.setdefault(session, {})[cap.token] = None
        return cap

    def find(self, token: object) -> Capability | None:
        """The capability `token` names, if any (a token of another type names none)."""
        return self._caps.get(token) if isinstance(token, str) else None

    def lookup(self, token: str, write: bool = False) -> Capability:
        cap = self.find(token)
        if cap is None:
            raise ProtocolError("EBADF", "no such capability (forged, revoked or expired)")
        if write and not cap.writable:
            raise ProtocolError("EACCES", "capability is read-only")
        return cap

    def revoke(self, token: str) -> None:
        """Revoke a capability and every grant derived from it (children first, so the
        object cannot be freed while the parent still holds it)."""
        for child in list(self._children.get(token, ())):
            if child in self._caps:
                self.revoke(child)
        self._children.pop(token, None)
        cap = self._caps.pop(token)
        if cap.parent is not None and cap.parent in self._children:
            siblings = self._children[cap.parent]
            siblings.pop(token, None)
            if not siblings:
                del self._children[cap.parent]
        if cap.session is not None:
            mine = self._per_session[cap.session]
            del mine[token]
            if not mine:
                del self._per_session[cap.session]
        left = self._per_object[cap.oid] - 1
        if left:
            self._per_object[cap.oid] = left
        else:
            del self._per_object[cap.oid]
            self._free_object(cap.oid)

    def revoke_session(self, session: int) -> int:
        """Revoke every capability of a session; how many there were."""
        tokens = list(self._per_session.get(session, ()))
        for token in tokens:
            if token in self._caps:   # a free callback may have revoked it already
                self.revoke(token)
        return len(tokens)

    def of_session(self, session: int) -> list[Capability]:
        return [self._caps[t] for t in self._per_session.get(session, ())]

    def count(self, session: int) -> int:
        """How many capabilities a session holds."""
        return len(self._per_session.get(session, ()))

    def check(self) -> list[str]:
        """Problems found comparing the indexes with the capability table."""
        problems = []
        per_object: dict[int, int] = {}
        for cap in self._caps.values():
            per_object[cap.oid] = per_object.get(cap.oid, 0) + 1
            if cap.session is not None and cap.token not in self._per_session.get(
                    cap.session, ()):
                problems.append(f"capability of object {cap.oid} missing from the index "
                                f"of session {cap.session}")
        if per_object != self._per_object:
            problems.append("capability counts per object do not match the table")
        indexed = sum(len(t) for t in self._per_session.values())
        if indexed != sum(1 for c in self._caps.values() if c.session is not None):
            problems.append("session index holds revoked capabilities")
        for parent, children in self._children.items():
            if parent not in self._caps or any(c not in self._caps or
                                               self._caps[c].parent != parent
                                               for c in children):
                problems.append("a derived grant outlived its parent or lost its link")
        return problems

    def objects(self) -> set[int]:
        return set(self._per_object)
