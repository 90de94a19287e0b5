"""Moving caches between replicas: `user.kv.rehome`, descriptors from another replica,
and files whose replica kvfsd no longer has.

* A move between two live replicas is bit-exact: `kv_export` on the one holding the
  cache, `kv_import` (persistent, charged to the file's owner, or to the writer of a
  descriptor) on the other; the old copy is freed once the file names the new one. It
  counts one migration and its export's bytes (`Replicas.count_migration`).
* A file whose home is down, or not one of kvfsd's replicas any more, is restored onto
  the target from its fsync'd snapshot instead (no snapshot: EIO and nothing changes);
  that counts as `restored`, not as a migration. Its old cache is freed when the old
  home answers again (`pending_free`), if it still has it.
* Rehoming needs the file closed (EBUSY): every open holds a grant on the home. It runs
  under the file's lock and checks the opens again just before the swap, so an open
  that raced the copy makes it EBUSY and the copy is freed. Same replica and alive:
  nothing to do. An address kvfsd does not have: EINVAL; the target down: EIO.
* A pinned file's new cache is pinned on the target before the swap (as any cache
  swapped into a file).
* At start, a file homed on an address not among `--predd` is re-homed onto the first
  live replica from its snapshot, or removed when it has none (as after a predd
  restart), with a log line; when no replica answers yet, the monitor does it later.

Layering: `Migration` is given only what it uses (`MigrationPorts`, built by
kvfsd/caches.py), never `Caches` itself; this module does not import kvfsd.caches, and
restoring a snapshot onto a replica is that replica's recovery's `restore`, passed in.
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
from kvfsd.replicas import Replicas


@dataclass(frozen=True)
class MigrationPorts:
    """What `Migration` uses of the caches (kvfsd/caches.py), and nothing else."""
    ns: Namespace
    replicas: Replicas
    log: Callable[[str], None]
    locks: defaultdict[int, trio.Lock]               # each file's lock, by inode
    link: Callable[[Node], PreddLink]                # the link to a file's home replica
    seen: Callable[[Node, dict], None]               # record predd's figures for a cache
    commit: Callable[[], Awaitable[None]]            # write the namespace's changes
    free: Callable[[str, str], Awaitable[None]]      # free (capability, replica)
    # pin a pinned file's new cache (capability, on that link) before it is installed
    carry_pin: Callable[[Node, str, PreddLink], Awaitable[None]]
    read_snapshot: Callable[[str], bytes]            # a snapshot's bytes, by name
    # (replica, node, stale capability, why it is lost): that replica's
    # `Recovery.restore` of the file's snapshot (kvfsd/recovery.py); whether restored
    restore: Callable[[str, Node, str | None, str], Awaitable[bool]]


class Migration:
    def __init__(self, ports: MigrationPorts) -> None:
        self.ports = ports
        self.replicas = ports.replicas
        self.log = ports.log
        # files homed on an address kvfsd does not have, still to re-home
        self.homeless: set[int] = {n.ino for n in ports.ns.files()
                                   if not self.replicas.known(n.replica)}
        # one move at a time per asking uid: a uid that moves files back and forth
        # queues behind its own moves, never ahead of other uids' (trusted kvfsd's
        # exports and imports have no rate limit in predd)
        self.movers: defaultdict[int, trio.Lock] = defaultdict(trio.Lock)

    def target(self, value: bytes) -> PreddLink:
        """The replica `user.kv.rehome=value` names (checked by kvfsd/xattrs.py): an
        address kvfsd has (else EINVAL), or for "" and `auto` the live replica with the
        most free pages (none live: EIO)."""
        text = value.strip().decode("ascii", "replace")
        if text in ("", "auto"):
            link = self.replicas.most_free()
            if link is None:
                raise pyfuse3.FUSEError(errno.EIO)
            return link
        link = self.replicas.named(text)
        if link is None:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return link

    async def rehome(self, node: Node, value: bytes, uid: int) -> None:
        """`setfattr -n user.kv.rehome -v ADDR FILE` by `uid`: move the file's cache to
        ADDR."""
        target = self.target(value)
        ports = self.ports
        async with self.movers[uid], ports.locks[node.ino]:
            home = ports.link(node)
            if target is home and home.up:
                return
            if node.opens > 0:
                raise pyfuse3.FUSEError(errno.EBUSY)
            if node.cap is None:
                raise pyfuse3.FUSEError(errno.ESTALE)
            if not target.up:
                raise pyfuse3.FUSEError(errno.EIO)
            if home.up:
                reply, nbytes = await self._copy(node.cap, home, target, node.uid)
            else:
                reply, nbytes = await self._from_snapshot(node, target), None
            await ports.carry_pin(node, reply["cap"], target)
            if node.opens > 0:                      # an open raced the copy
                await ports.free(reply["cap"], target.addr)
                raise pyfuse3.FUSEError(errno.EBUSY)
            old, old_home = node.cap, node.replica
            node.cap, node.replica = reply["cap"], target.addr
            ports.seen(node, reply)
            await ports.commit()
            await ports.free(old, old_home)
            path = ports.ns.path_of(node.ino)
            if nbytes is None:
                self.replicas.restored += 1
                self.log(f"{path}: restored onto {target.addr} from its fsync'd snapshot "
                         f"({node.tokens} tokens; {old_home} is down)")
            else:
                self.replicas.count_migration(nbytes)
                self.log(f"{path}: moved from {old_home} to {target.addr} ({nbytes} bytes)")

    async def carry(self, path: str, cap: str, source: PreddLink, target: PreddLink,
                    owner: int) -> dict:
        """Move the persistent cache `cap` from `source` to `target` (a fork written
        into a file homed on `target`): the import's reply; `cap` is freed either way."""
        try:
            reply, nbytes = await self._copy(cap, source, target, owner)
        finally:
            await self.ports.free(cap, source.addr)
        self.replicas.count_migration(nbytes)
        self.log(f"{path}: a cache written into it moved from {source.addr} to "
                 f"{target.addr} ({nbytes} bytes)")
        return reply

    async def _copy(self, cap: str, source: PreddLink, target: PreddLink,
                    owner: int) -> tuple[dict, int]:
        """Export `cap` on `source`, import it on `target` charged to `owner`: the
        import's reply (its persistent capability) and the export's length."""
        try:
            _, frames = await source.request("kv_export", cap=cap, timeout=source.t.bulk_s)
            blob = bytes(frames[0] if frames else b"")
            reply = await target.call("kv_import", frames=(blob,), persist=True,
                                      owner=owner, timeout=target.t.bulk_s)
        except PreddError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        return reply, len(blob)

    async def _from_snapshot(self, node: Node, target: PreddLink) -> dict:
        if not node.snapshot:
            raise pyfuse3.FUSEError(errno.EIO)
        try:
            blob = await trio.to_thread.run_sync(self.ports.read_snapshot,
                                                 node.snapshot)
            return await target.call("kv_import", frames=(blob,), persist=True,
                                     owner=node.uid, timeout=target.t.bulk_s)
        except (OSError, PreddError) as exc:
            self.log(f"{self.ports.ns.path_of(node.ino)}: cannot restore its snapshot "
                     f"onto {target.addr} ({type(exc).__name__})")
            raise pyfuse3.FUSEError(errno.EIO) from None

    async def rehome_homeless(self) -> None:
        """Files homed on an address kvfsd does not have: onto the first live replica,
        from their snapshots (or removed). Nothing while no replica answers."""
        while self.homeless:
            target = self.replicas.first_live()
            if target is None:
                return
            node = self.ports.ns.nodes.get(self.homeless.pop())
            if node is None or not node.is_file or node.nlink == 0 \
                    or self.replicas.known(node.replica):
                continue
            async with self.ports.locks[node.ino]:
                gone = node.replica
                self.log(f"{self.ports.ns.path_of(node.ino)}: its replica {gone} is not "
                         f"one of kvfsd's; re-homing it onto {target.addr}")
                node.replica = target.addr
                if await self.ports.restore(target.addr, node, node.cap,
                                            f"its replica {gone} is gone"):
                    self.replicas.restored += 1
            await self.ports.commit()
