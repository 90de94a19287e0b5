"""Memory policy set through xattrs, carried out by predd (`kv_policy`, on the file's
own persistent rw capability).

* `user.kv.pin=1` keeps the file's cache on predd's device; `0` (or removing it) lets it
  move down. The pin belongs to the file: it is sent before the value is stored, so
  predd's refusal (EDQUOT: the pin quota of the uid the cache is charged to) reaches
  setfattr and nothing is stored; a cache that replaces the file's (a descriptor written
  into it, an O_TRUNC open, an import after a predd restart) is pinned before it is
  installed; every re-validation (kvfsd start, predd restart) pins the pinned files
  again, dropping — with a log line — a pin predd no longer grants.
* `user.kv.evict=1` moves the cache down now: an action, never stored (EBUSY from predd
  when it is pinned or in use).
* A predd without `kv_policy` (ENOSYS) cannot act on a pin: it is recorded, as a hint,
  and applied by the first re-validation against a predd that can; evict then fails
  with EOPNOTSUPP.

Layering: `Policy` is given only what it uses (`PolicyPorts`, built by kvfsd/caches.py),
never `Caches` itself; this module does not import kvfsd.caches.
"""
from __future__ import annotations

import errno
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pyfuse3
import trio

from kvfsd.namespace import Namespace
from kvfsd.node import Node
from kvfsd.predd_link import PreddError, PreddLink
from kvfsd.xattrs import PIN


def pinned(node: Node) -> bool:
    return node.xattrs.get(PIN, b"").strip() == b"1"


@dataclass(frozen=True)
class PolicyPorts:
    """What `Policy` uses of the caches (kvfsd/caches.py), and nothing else."""
    ns: Namespace
    log: Callable[[str], None]
    locks: defaultdict[int, trio.Lock]                 # each file's lock, by inode
    link: Callable[[Node], PreddLink]                  # the link to a file's home replica
    # `op` on a file's cache, on its home replica: (header, frames), or FUSEError
    on_cache: Callable[..., Awaitable[tuple[dict, list]]]


class Policy:
    def __init__(self, ports: PolicyPorts) -> None:
        self.ports = ports

    async def set_pin(self, node: Node, value: bytes | None) -> None:
        """Set user.kv.pin to `value` (checked already), or remove it (None): predd
        first, then the namespace, under the file's lock, so a cache swapped in
        meanwhile (which takes the lock) sees the pin as it ends up."""
        async with self.ports.locks[node.ino]:
            if value is not None or pinned(node):
                try:
                    await self.ports.on_cache(node, "kv_policy",
                                              pin=value is not None and value.strip() == b"1")
                except pyfuse3.FUSEError as exc:
                    if exc.errno != errno.ENOSYS:
                        raise              # ENOSYS: an older predd; a hint only
            if value is None:
                self.ports.ns.removexattr(node, PIN)
            else:
                self.ports.ns.setxattr(node, PIN, value)

    async def evict(self, node: Node) -> None:
        try:
            await self.ports.on_cache(node, "kv_policy", evict=True)
        except pyfuse3.FUSEError as exc:
            if exc.errno == errno.ENOSYS:
                raise pyfuse3.FUSEError(errno.EOPNOTSUPP) from None
            raise

    async def carry_pin(self, node: Node, cap: str, link: PreddLink) -> None:
        """Pin `cap` (on replica `link`), about to become the cache of pinned file
        `node`; PreddError if predd refuses (the caller frees `cap` and leaves the file
        as it was)."""
        if pinned(node):
            try:
                await link.call("kv_policy", cap=cap, pin=True)
            except PreddError as exc:
                if exc.code != "ENOSYS":
                    raise

    async def reapply(self, node: Node) -> bool:
        """Pin a pinned file's cache again (after a re-validation); False when predd
        cannot be asked. A pin predd refuses is dropped, with a log line."""
        if not pinned(node) or node.cap is None:
            return True
        try:
            await self.ports.link(node).call("kv_policy", cap=node.cap, pin=True)
        except PreddError as exc:
            if exc.code == "ENOSYS":
                return True
            if exc.code in ("EIO", "ETIMEDOUT"):
                return False
            self.ports.log(f"{self.ports.ns.path_of(node.ino)}: pin not granted again "
                           f"({exc.code}); user.kv.pin removed")
            self.ports.ns.removexattr(node, PIN)
        return True
