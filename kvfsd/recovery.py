"""Recovery after a predd restart: the files get caches from the new predd, or go.

One `Recovery` per replica (kvfsd/replicas.py): each follows its own predd and
re-validates, restores or drops only the files homed on it (`Node.replica`), and
retries only the frees meant for it. Below, "predd" is that replica.

A predd that restarts loses every KV object and every capability, kvfsd's persistent
ones (a file's `Node.cap`) included. The rule:
* kvfsd notices in one of two ways: the monitor sees a predd with another start time
  (`PreddLink.poll`, every `poll_s`), or a call on a file's capability answers EBADF
  (`Caches.on_cache` then re-validates once and retries the call).
* Re-validation asks predd about every file's capability (`kv_stat`). A capability
  predd does not know (EBADF, ENOENT) is replaced by importing the file's last fsync'd
  snapshot, charged to the file's owner; a file without a snapshot, or whose snapshot
  will not import, loses its names and its snapshot, with one log line. Any other
  answer stops the pass; the monitor tries again at the next poll (`stale` stays set).
* One pass at a time. A request that met a stale capability waits for a pass, and
  starts none if one completed since it saw `generation`.
* A file whose cache a writer replaced while its snapshot was importing keeps the
  writer's cache; the import is freed.
* Opens made before the restart keep their old grants, which predd no longer knows:
  calls with them fail (EBADF). Cache operations through an open whose file lost its
  cache (fsync, emptying) get ESTALE.
* Frees predd did not confirm (`pending_free`) are retried after each pass.
* Each pass pins the pinned files again (kvfsd/policy.py): a cache imported from a
  snapshot is a new object, and a pin predd refuses now is dropped with a log line.
* Each poll that finds predd up and its caches re-validated also re-homes the files
  of replicas kvfsd no longer has (kvfsd/migration.py).

Layering: `Recovery` is given only what it uses (`RecoveryPorts`, built by
kvfsd/caches.py), never `Caches` itself; this module does not import kvfsd.caches, and
the pins (`Policy.reapply`) and re-homing (`Migration.rehome_homeless`) it needs are
passed in as those functions.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import pyfuse3
import trio

from kvfsd.namespace import Namespace
from kvfsd.node import Node
from kvfsd.predd_link import PreddError, PreddLink


@dataclass(frozen=True)
class RecoveryPorts:
    """What a `Recovery` uses of the caches (kvfsd/caches.py), and nothing else; one
    for every replica's."""
    ns: Namespace
    log: Callable[[str], None]
    seen: Callable[[Node, dict], None]               # record predd's figures for a cache
    commit: Callable[[], Awaitable[None]]            # write the namespace's changes
    unsaved: Callable[[], bool]                      # changes not written yet
    free: Callable[[str, str], Awaitable[None]]      # free (capability, replica)
    # the frees predd did not confirm meant for a replica: (replica, capability) pairs,
    # still pending (`pending_frees`) or taken off the list to be retried (`take_frees`)
    pending_frees: Callable[[str], list[tuple[str, str]]]
    take_frees: Callable[[str], list[tuple[str, str]]]
    read_snapshot: Callable[[str], bytes]            # a snapshot's bytes, by name
    remove_snapshot: Callable[[str], None]
    mounted: Callable[[], bool]                      # whether the kernel knows our names
    reapply: Callable[[Node], Awaitable[bool]]       # Policy.reapply: pin a pinned file
    rehome_homeless: Callable[[], Awaitable[None]]   # Migration.rehome_homeless


class Recovery:
    def __init__(self, link: PreddLink, ports: RecoveryPorts) -> None:
        self.ports = ports
        self.predd = link
        self.log = ports.log
        self.generation = 0          # completed re-validations
        self.stale = False           # predd restarted; caches not re-validated yet
        self._revalidating = trio.Lock()

    async def monitor(self) -> None:
        """Follow predd: liveness, restarts (re-validate), deferred frees, and figures
        not written to the state directory yet."""
        next_poll = 0.0
        while True:
            try:                           # never let the monitor die
                await self.predd.probe()
                if trio.current_time() >= next_poll:
                    next_poll = trio.current_time() + self.predd.t.poll_s
                    await self.check_predd()
                if self.ports.unsaved():
                    await self.ports.commit()
            except Exception as exc:
                self.log(f"monitor: {type(exc).__name__}")
            await trio.sleep(self.predd.t.probe_s)

    async def check_predd(self) -> None:
        """Poll predd; re-validate after a restart (until one succeeds); retry frees."""
        first = self.predd.instance is None
        why = ""
        if await self.predd.poll():
            self.stale = True
            why = (f"first contact with predd at {self.predd.addr}" if first
                   else f"predd at {self.predd.addr} restarted")
        if self.predd.up and (self.stale or self._frees()):
            if await self.revalidate(None, why if self.stale else ""):
                self.stale = False
        if self.predd.up and not self.stale:
            await self.ports.rehome_homeless()     # nothing when there are none

    def _frees(self) -> list[tuple[str, str]]:
        return self.ports.pending_frees(self.predd.addr)

    def _homed_here(self) -> list[Node]:
        return [n for n in self.ports.ns.files() if n.replica == self.predd.addr]

    async def revalidate(self, seen_generation: int | None = None, why: str = "") -> bool:
        """Check every cache's capability with predd. A stale one is re-imported from
        its fsync'd snapshot, or dropped with a log line. False when predd could not be
        asked (try again later)."""
        ports = self.ports
        async with self._revalidating:
            if seen_generation is not None and self.generation > seen_generation:
                return True                   # someone re-validated meanwhile
            if why:
                self.log(f"re-validating caches: {why}")
            for node in self._homed_here():
                cap = node.cap
                if node.replica != self.predd.addr:
                    continue                  # re-homed meanwhile
                if cap is not None:
                    try:
                        ports.seen(node, await self.predd.call("kv_stat", cap=cap))
                        continue
                    except PreddError as exc:
                        if exc.code not in ("EBADF", "ENOENT"):
                            self.log(f"re-validation stopped: {exc.code}")
                            return False
                if node.cap == cap and node.replica == self.predd.addr:
                    await self.restore(node, cap)    # else replaced meanwhile: fresh
            for node in self._homed_here():
                if not await ports.reapply(node):
                    self.log("re-validation stopped: predd did not answer a pin")
                    return False
            for replica, cap in ports.take_frees(self.predd.addr):
                await ports.free(cap, replica)
            self.generation += 1
            await ports.commit()
            return True

    async def restore(self, node: Node, stale: str | None,
                      lost: str = "predd restarted") -> bool:
        """Import the file's snapshot onto this replica in place of `stale`, or drop
        the file (no snapshot, or it will not import; `lost` says why its cache is
        gone). Whether it was restored."""
        ports = self.ports
        path = ports.ns.path_of(node.ino)
        if node.snapshot:
            try:
                blob = await trio.to_thread.run_sync(ports.read_snapshot, node.snapshot)
                reply = await self.predd.call("kv_import", frames=(blob,), persist=True,
                                              owner=node.uid, timeout=self.predd.t.bulk_s)
            except (OSError, PreddError) as exc:
                self.log(f"{path}: cannot restore its snapshot ({exc}); removing it")
            else:
                if node.cap != stale:         # raced with a replacement: keep that
                    await ports.free(reply["cap"], self.predd.addr)
                    return True
                node.cap = reply["cap"]
                ports.seen(node, reply)
                self.log(f"{path}: restored from its fsync'd snapshot "
                         f"({node.tokens} tokens)")
                return True
        else:
            self.log(f"{path}: cache lost ({lost} and it was never fsync'd); removing it")
        node.cap = None
        if node.snapshot:
            ports.remove_snapshot(node.snapshot)
            node.snapshot = None
        for parent, name in ports.ns.drop_names(node.ino):
            if ports.mounted():            # before the mount the kernel knows no name
                pyfuse3.invalidate_entry_async(parent, name, deleted=node.ino,
                                               ignore_enoent=True)
        ports.ns.collect(node)
        return False
