"""Time to live (`user.kv.ttl=S`): a cache file neither used nor closed for S seconds
is removed — every name it has, as `rm` of each would — and its cache freed.

* Last close: kvfsd's release of the file's last open (`Node.closed_at`); for a file not
  opened since kvfsd started, the start.
* Last use: predd's `idle_s` (kv_stat: seconds since a pred, generate, fork or export
  used the cache, or since it was made). A predd that does not report it: last close
  only.
* A file with an open is never removed, nor one whose ttl changed or that lost its
  names meanwhile, nor any while its home replica's predd cannot be asked.
Only files with a ttl are looked at, when they are due: a heap of (when due, inode),
checked every `PERIOD` seconds, so a check costs O(log n) per file due and never a scan
of the namespace (the one scan is at start, to find the files with a ttl).

Layering: `Expiry` is given only what it uses (`ExpiryPorts`, built by kvfsd/caches.py),
never `Caches` itself; this module does not import kvfsd.caches.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pyfuse3
import trio

from kvfsd.namespace import Namespace
from kvfsd.node import Node
from kvfsd.predd_link import PreddError, PreddLink
from kvfsd.xattrs import TTL

PERIOD = 1.0


def ttl_of(node: Node) -> int | None:
    value = node.xattrs.get(TTL)
    return int(value.strip()) if value is not None and node.is_file else None


@dataclass(frozen=True)
class ExpiryPorts:
    """What `Expiry` uses of the caches (kvfsd/caches.py), and nothing else."""
    ns: Namespace
    log: Callable[[str], None]
    link: Callable[[Node], PreddLink]            # the link to a file's home replica
    commit: Callable[[], Awaitable[None]]        # write the namespace's changes
    maybe_free: Callable[[Node], Awaitable[None]]   # free a cache nothing refers to


class Expiry:
    def __init__(self, ports: ExpiryPorts) -> None:
        self.ports = ports
        self.started = time.monotonic()
        self._due: dict[int, float] = {}            # inode -> when it is next looked at
        self._heap: list[tuple[float, int]] = []    # (due, inode); stale pairs skipped

    def watch_all(self) -> None:
        """At start: every file with a ttl."""
        for node in self.ports.ns.nodes.values():
            if ttl_of(node) is not None:
                self.watch(node)

    def watch(self, node: Node, due: float | None = None) -> None:
        """Look at `node` at `due` (now: at the next check)."""
        due = time.monotonic() if due is None else due
        self._due[node.ino] = due
        heapq.heappush(self._heap, (due, node.ino))

    def __len__(self) -> int:
        return len(self._due)

    async def run(self) -> None:
        while True:
            await trio.sleep(PERIOD)
            try:                           # never let the task die
                await self.check()
            except Exception as exc:
                self.ports.log(f"expiry: {type(exc).__name__}")

    async def check(self, now: float | None = None) -> None:
        """Remove the files whose ttl ran out; look again later at the others."""
        now = time.monotonic() if now is None else now
        while self._heap and self._heap[0][0] <= now:
            due, ino = heapq.heappop(self._heap)
            if self._due.get(ino) != due:
                continue                   # re-scheduled since: a later pair stands
            del self._due[ino]
            node = self.ports.ns.nodes.get(ino)
            if node is None or node.nlink == 0 or ttl_of(node) is None:
                continue                   # gone, or its ttl was removed
            await self._consider(node, now)

    async def _consider(self, node: Node, now: float) -> None:
        ttl = ttl_of(node)
        quiet_since = max(node.closed_at, self.started)
        if node.opens > 0:
            self.watch(node, now + PERIOD)             # closes are seen at release
            return
        if now - quiet_since < ttl:
            self.watch(node, quiet_since + ttl)
            return
        predd = self.ports.link(node)           # the file's home replica
        if not predd.up or node.cap is None:
            self.watch(node, now + PERIOD)
            return
        cap = node.cap
        try:
            reply = await predd.call("kv_stat", cap=cap)
        except PreddError:
            self.watch(node, now + PERIOD)             # re-validation sorts stale ones
            return
        if "idle_s" in reply:
            quiet_since = max(quiet_since, time.monotonic() - float(reply["idle_s"]))
        now = time.monotonic()
        if node.cap != cap or node.opens > 0 or node.nlink == 0 or ttl_of(node) != ttl:
            if node.nlink and ttl_of(node) is not None:
                self.watch(node, now + PERIOD)         # changed while predd answered
            return
        if now - quiet_since < ttl:
            self.watch(node, quiet_since + ttl)
            return
        await self._remove(node, ttl)

    async def _remove(self, node: Node, ttl: int) -> None:
        ports = self.ports
        path = ports.ns.path_of(node.ino)
        names = ports.ns.drop_names(node.ino)
        await ports.commit()
        for parent, name in names:
            pyfuse3.invalidate_entry_async(parent, name, deleted=node.ino, ignore_enoent=True)
        ports.log(f"{path}: removed (user.kv.ttl {ttl} s ran out)")
        await ports.maybe_free(node)
