"""The caches behind the files: each file's predd object, from creation to free.

Lifetime rules:
* A cache file's name holds one persistent, rw capability (`Node.cap`); it never leaves
  kvfsd. It is freed when the last name and the last open are gone (`maybe_free`).
* Every object kvfsd makes for a request is charged to that request's uid (`owner`):
  a new file to its creator, a fork written into a file to the writer, a restored
  snapshot to the file's owner. predd answers EDQUOT past the uid's quota.
* Each readable open holds a session-bound (never persistent) grant, rendered as its
  descriptor, and revoked at that open's release: after a chmod or rm, the rights of
  earlier opens end with those opens. `copy_file_range` (coreutils cp) splices through
  the inode's shared page cache, so a concurrent open may read another open's
  descriptor and write it after that open was released: such a revoked grant is
  honoured only for a writer that holds a readable open of the same file itself, by
  forking from *its own* grant (`_revoked`).
* Replacing a file's cache (a descriptor written into it) swaps `Node.cap` and frees
  the old one. An O_TRUNC open swaps in a fresh empty cache at flush and keeps the old
  one (`Handle.backup`) until release, so a descriptor refused afterwards puts the old
  cache back untouched. Operations that swap or empty a cache hold the file's lock.
* A capability predd does not know any more (predd restarted) sends every cache
  through re-validation (kvfsd/recovery.py) once, then the call is retried.
* A free that predd did not confirm is retried (`pending_free`, persisted, with the
  replica it is for) after that replica's next re-validation.
* Replicas (kvfsd/replicas.py): every file has a home replica (`Node.replica`), and
  every call on its cache goes to that replica's link (`link`). A new file is made on
  the first live replica. A descriptor written into a file names the replica holding
  the cache it forks (`replica ADDR`; none: the file's home); a cache on another
  replica than the file's is moved (kvfsd/migration.py), or the file re-homed when its
  own cache was empty and nobody else had it open. Each open's grant and each kept
  cache records its replica, so it is freed there.

Layering: `Caches` builds its helpers — one `Recovery` per replica (kvfsd/recovery.py),
`Policy` (kvfsd/policy.py), `Expiry` (kvfsd/expiry.py), `Migration`
(kvfsd/migration.py) — and hands each only the functions and state it uses (its
`*Ports`), never itself: no helper imports this module, and one helper's function
another needs (`Policy.reapply`, `Migration.rehome_homeless`, a replica's
`Recovery.restore`) is passed to it as that function.
"""
from __future__ import annotations

import errno
import time
from collections import OrderedDict, defaultdict

import pyfuse3
import trio

from kvfsd.expiry import Expiry, ExpiryPorts
from kvfsd.handles import Handle
from kvfsd.migration import Migration, MigrationPorts
from kvfsd.namespace import FORMAT, Changes, Namespace
from kvfsd.node import Node
from kvfsd.policy import Policy, PolicyPorts
from kvfsd.predd_link import PreddError, PreddLink
from kvfsd.recovery import Recovery, RecoveryPorts
from kvfsd.replicas import Replicas
from kvfsd.state import StateDir
from symphony_protocol import descriptor
# A descriptor naming a capability predd does not know (forged, revoked, expired) or
# cannot fork from is "not a valid descriptor".
BAD_DESCRIPTOR = ("EBADF", "ENOENT", "EINVAL", "EACCES")
REVOKED_KEPT = 4096      # revoked grants remembered for the splice rule above


def fuse_error(exc: Exception) -> pyfuse3.FUSEError:
    if isinstance(exc, PreddError | OSError):
        return pyfuse3.FUSEError(exc.errno or errno.EIO)
    return pyfuse3.FUSEError(errno.EIO)


class Caches:
    def __init__(self, ns: Namespace, state: StateDir, replicas: Replicas, log,
                 pending_free: list | None = None) -> None:
        self.ns = ns
        self.state = state
        self.replicas = replicas
        self.predd = replicas.first       # replica 0: the model's facts (all serve one)
        self.log = log
        # frees predd did not confirm: (replica, capability); a bare capability (a state
        # from before replicas) is replica 0's; one on a replica kvfsd no longer has
        # cannot be done and is dropped
        entries = [(replicas.first.addr, entry) if isinstance(entry, str)
                   else (str(entry[0]) or replicas.first.addr, str(entry[1]))
                   for entry in pending_free or []]
        self.pending_free: list[tuple[str, str]] = [e for e in entries
                                                    if replicas.known(e[0])]
        for node in ns.nodes.values():    # a state from before replicas: replica 0's
            if node.is_file and not node.replica:
                node.replica = replicas.first.addr
        self.locks: defaultdict[int, trio.Lock] = defaultdict(trio.Lock)
        self.handles: dict[int, Handle] = {}      # live opens, by fh (kept by KvFs)
        self._revoked: OrderedDict[str, int] = OrderedDict()   # grant -> inode
        self._backups: set[tuple[str, str]] = set()   # old caches held by O_TRUNC opens
        self._orphans: dict[int, tuple[str, str]] = {}   # caches of removed open files
        self._changes = 0                         # namespace changes made ...
        self._written = 0                         # ... and recorded in the state dir
        self._writing = trio.Lock()
        self._refreshing: dict[int, trio.Event] = {}     # kv_stat in flight, per inode
        self.mounted = False                      # the kernel knows our names (serve)
        # the helpers, each given only what it uses (see "Layering" above)
        self.policy = Policy(PolicyPorts(ns=ns, log=log, locks=self.locks, link=self.link,
                                         on_cache=self.on_cache))
        self.recoveries: dict[str, Recovery] = {}
        self.migration = Migration(MigrationPorts(
            ns=ns, replicas=replicas, log=log, locks=self.locks, link=self.link,
            seen=self.seen, commit=self.commit, free=self.free, carry_pin=self.carry_pin,
            read_snapshot=state.read_snapshot, restore=self._restore_on))
        ports = RecoveryPorts(
            ns=ns, log=log, seen=self.seen, commit=self.commit,
            unsaved=lambda: self.unsaved, free=self.free,
            pending_frees=self._pending_frees, take_frees=self._take_frees,
            read_snapshot=state.read_snapshot, remove_snapshot=state.remove_snapshot,
            mounted=lambda: self.mounted, reapply=self.policy.reapply,
            rehome_homeless=self.migration.rehome_homeless)
        self.recoveries.update((link.addr, Recovery(link, ports)) for link in replicas)
        self.expiry = Expiry(ExpiryPorts(ns=ns, log=log, link=self.link, commit=self.commit,
                                         maybe_free=self.maybe_free))

    def link(self, node: Node) -> PreddLink:
        """The link to a file's home replica (one kvfsd does not have: calls give EIO)."""
        return self.replicas.get(node.replica)

    async def _restore_on(self, replica: str, node: Node, stale: str | None,
                          lost: str) -> bool:
        """Migration's restore: replica `replica`'s recovery imports the file's snapshot
        in place of `stale`, or drops the file (`Recovery.restore`)."""
        return await self.recoveries[replica].restore(node, stale, lost=lost)

    def _pending_frees(self, replica: str) -> list[tuple[str, str]]:
        """The frees predd did not confirm that are meant for `replica`."""
        return [entry for entry in self.pending_free if entry[0] == replica]

    def _take_frees(self, replica: str) -> list[tuple[str, str]]:
        """The same, taken off the list (the caller retries them; a free that fails
        again is put back by `free`)."""
        frees = self._pending_frees(replica)
        self.pending_free = [entry for entry in self.pending_free if entry[0] != replica]
        return frees

    # ------------------------------------------------------------ persistence

    def _meta(self) -> dict:
        # Caches of removed-but-open files are freed at release, and old caches kept by
        # O_TRUNC opens at theirs; should kvfsd die first, the next one frees them.
        return {"format": FORMAT, "next_ino": self.ns.next_ino,
                "pending_free": [list(entry) for entry in self.pending_free
                                 + sorted(self._orphans.values()) + sorted(self._backups)]}

    def _take_changes(self) -> Changes:
        changes = self.ns.take_changes()
        for ino in changes.inos:
            node = self.ns.nodes.get(ino)
            if node is not None and node.is_file and node.nlink == 0 and node.cap is not None:
                self._orphans[ino] = (node.replica, node.cap)
            else:
                self._orphans.pop(ino, None)
        return changes

    async def commit(self) -> None:
        """Write every change made before this call to the state directory (durably, in
        one transaction of the rows that changed). Concurrent commits share one write
        (group commit); the write runs off the event loop."""
        self._changes += 1
        wanted = self._changes
        async with self._writing:
            if self._written >= wanted:
                return                     # a write started after our change covered it
            upto, changes, meta = self._changes, self._take_changes(), self._meta()
            try:
                await trio.to_thread.run_sync(self.state.apply, changes.rows, changes.gone,
                                              changes.entries, meta)
            except BaseException:
                self.ns.untake(changes)    # written with the next commit
                raise
            self._written = upto

    def save_now(self) -> None:
        """The final write, outside trio (at unmount)."""
        changes = self._take_changes()
        self.state.apply(changes.rows, changes.gone, changes.entries, self._meta())
        self._written = self._changes

    @property
    def unsaved(self) -> bool:
        """Changes not written yet: figures and times (`seen`) need not be on disk before
        a reply; the monitor commits them within `probe_s`."""
        return bool(self.ns.dirty or self.ns.dirty_entries)

    def remove_unused_snapshots(self) -> None:
        """Snapshots no inode refers to (a kvfsd that died mid-way left them)."""
        used = {n.snapshot for n in self.ns.nodes.values() if n.snapshot}
        for name in self.state.snapshot_names() - used:
            self.state.remove_snapshot(name)

    # ------------------------------------------------------------ figures

    def seen(self, node: Node, reply: dict) -> None:
        """Record predd's figures for a cache; mtime moves when its length changes."""
        tokens = int(reply.get("tokens", node.tokens))
        node.pages = int(reply.get("pages", node.pages))
        node.bytes = int(reply.get("bytes", node.bytes))
        if "tier" in reply:
            node.tier = str(reply["tier"])
        if tokens != node.tokens:
            node.tokens = tokens
            node.touch()

    async def refresh(self, node: Node, strict: bool = False) -> None:
        """Update a cache's figures, waiting at most `stat_s`: predd answers a kv_stat
        only after the calls queued on that cache (a long generate), so past that the
        last-seen figures stand and the answer is applied when it comes. `strict`: EIO
        when predd is down (a plain stat never fails because of predd)."""
        if not node.is_file or node.cap is None:
            return
        link = self.link(node)
        if not link.up:
            if strict:
                raise pyfuse3.FUSEError(errno.EIO)
            return
        done = self._refreshing.get(node.ino)
        if done is None:
            done = self._refreshing[node.ino] = trio.Event()
            trio.lowlevel.spawn_system_task(self._stat, node, link, done)
        with trio.move_on_after(link.t.stat_s):
            await done.wait()

    async def _stat(self, node: Node, link: PreddLink, done: trio.Event) -> None:
        cap = node.cap
        try:
            header = await link.call("kv_stat", cap=cap)
            if node.cap == cap:
                self.seen(node, header)
        except PreddError:
            pass
        except Exception as exc:    # a system task must not raise
            self.log(f"stat: {type(exc).__name__}: {exc}")
        finally:
            self._refreshing.pop(node.ino, None)
            done.set()

    # ------------------------------------------------------------ predd calls

    async def on_cache(self, node: Node, op: str, **fields) -> tuple[dict, list]:
        """`op` on a file's cache, on its home replica. A stale capability (that predd
        restarted) triggers one re-validation of that replica and a retry."""
        for attempt in (0, 1):
            cap, link = node.cap, self.link(node)
            if cap is None:
                break
            try:
                return await link.request(op, cap=cap, **fields)
            except PreddError as exc:
                recovery = self.recoveries.get(link.addr)
                if exc.code == "EBADF" and attempt == 0 and recovery is not None:
                    await recovery.revalidate(recovery.generation, "a capability went stale")
                    continue
                raise fuse_error(exc) from None
        raise pyfuse3.FUSEError(errno.ESTALE)

    async def create(self, owner: int, link: PreddLink | None = None) -> dict:
        """A new empty cache with a persistent capability, charged to uid `owner`, on
        `link` (default: the next replica in turn, `Replicas.next_home`); the reply names
        its `replica`."""
        link = link or self.replicas.next_home()
        try:
            reply = await link.call("kv_create", persist=True, owner=owner)
        except PreddError as exc:
            raise fuse_error(exc) from None
        return {**reply, "replica": link.addr}

    async def free(self, cap: str, replica: str) -> None:
        """Free `cap` on replica `replica`; retried later if it does not answer. (On an
        address kvfsd does not have, nothing can be freed.)"""
        if not self.replicas.known(replica):
            return
        try:
            await self.replicas.get(replica).call("kv_free", cap=cap)
        except PreddError as exc:
            if exc.code != "EBADF":          # EBADF: gone with a restarted predd
                self.pending_free.append((replica, cap))
                await self.commit()

    async def maybe_free(self, node: Node) -> None:
        """Free the cache of a file with no name and no open; drop the node when the
        kernel has forgotten it too."""
        if Namespace.cache_unreferenced(node) and node.cap is not None:
            cap, node.cap = node.cap, None
            if node.snapshot:
                self.state.remove_snapshot(node.snapshot)
                node.snapshot = None
            await self.free(cap, node.replica)
        if self.ns.collect(node):
            self.locks.pop(node.ino, None)

    # ------------------------------------------------------------ opens

    async def grant(self, handle: Handle) -> None:
        """A fresh capability for a readable open, and the descriptor it reads. It is
        bound to kvfsd's session (never persistent) and revoked at this open's release."""
        rights = "rw" if handle.writable else "r"
        for _ in range(3):
            replica = handle.node.replica
            header, _ = await self.on_cache(handle.node, "kv_grant", rights=rights,
                                            persist=False)
            if handle.node.replica == replica:
                break
            await self.free(header["cap"], replica)   # re-homed meanwhile: again there
        else:
            raise pyfuse3.FUSEError(errno.EAGAIN)
        handle.cap, handle.replica = header["cap"], replica
        handle.data = descriptor.Descriptor(
            header["cap"], rights, int(header["tokens"]), int(header["pages"]),
            header.get("model", ""), replica).encode()
        self.seen(handle.node, header)

    async def apply(self, handle: Handle) -> None:
        """Make what was written through `handle` take effect: a descriptor forks its
        cache into this file; O_TRUNC with nothing written empties it. A refused
        descriptor puts back the cache an earlier flush of this open emptied."""
        node = handle.node
        async with self.locks[node.ino]:
            if handle.written:
                try:
                    await self._fork_into(node, handle.take_descriptor(), handle)
                except Exception:
                    await self._restore_backup(handle)
                    raise
            elif handle.truncate:
                handle.truncate = False
                if handle.backup is None:
                    await self._swap_in_empty(node, handle)
                else:
                    await self._truncate(node, 0)

    async def _fork_into(self, node: Node, desc: descriptor.Descriptor,
                         handle: Handle) -> None:
        path = self.ns.path_of(node.ino)
        source = self.replicas.named(desc.replica) if desc.replica else self.link(node)
        if source is None:
            self.log(f"{path}: descriptor refused: not one of kvfsd's replicas")
            raise pyfuse3.FUSEError(errno.EINVAL)
        source_addr = source.addr
        model = source.info.get("model")
        if desc.model and model and desc.model != model:
            self.log(f"{path}: descriptor refused: another model")
            raise pyfuse3.FUSEError(errno.EINVAL)
        try:
            reply = await source.call("kv_fork", cap=desc.cap, rights="rw",
                                      persist=True, owner=handle.uid)
        except PreddError as exc:
            if exc.code not in BAD_DESCRIPTOR:
                raise fuse_error(exc) from None
            own = self._own_grant_for(desc.cap, handle.uid, source_addr)
            if own is None:
                self.log(f"{path}: descriptor refused: {exc.code}")
                raise pyfuse3.FUSEError(errno.EINVAL) from None
            try:
                reply = await source.call("kv_fork", cap=own, rights="rw",
                                          persist=True, owner=handle.uid)
            except PreddError as exc2:
                raise fuse_error(exc2) from None
        home = self.link(node)
        if source is not home:
            if await self._empty_and_unshared(node):
                home = source                  # the file re-homes to the cache
            else:
                reply = await self.migration.carry(path, reply["cap"], source, home,
                                                   handle.uid)
        await self.carry_pin(node, reply["cap"], home)
        old, old_home = node.cap, node.replica
        node.cap, node.replica = reply["cap"], home.addr
        self.seen(node, reply)
        node.touch()
        await self.commit()
        if old is not None:
            await self.free(old, old_home)

    async def _empty_and_unshared(self, node: Node) -> bool:
        """A file whose cache has no entries and no open but the writer's may simply
        move to another replica (nothing to carry over)."""
        if node.opens > 1:
            return False
        link = self.link(node)
        if link.up and node.cap is not None:
            try:
                self.seen(node, await link.call("kv_stat", cap=node.cap))
            except PreddError:
                pass
        return node.tokens == 0

    def _own_grant_for(self, revoked: str, uid: int, replica: str) -> str | None:
        """The splice rule: `revoked` was an open's grant on file F, now revoked; the
        live grant (on `replica`) of a readable open of F held by `uid` itself, if any."""
        ino = self._revoked.get(revoked)
        if ino is None:
            return None
        for h in self.handles.values():
            if h.node.ino == ino and h.uid == uid and h.cap is not None and h.readable \
                    and h.replica == replica:
                return h.cap
        return None

    async def _swap_in_empty(self, node: Node, handle: Handle) -> None:
        """O_TRUNC: the file names a fresh empty cache; the old one is kept, untouched,
        until release."""
        if node.cap is None:
            raise pyfuse3.FUSEError(errno.ESTALE)
        home = self.link(node)
        reply = await self.create(owner=handle.uid, link=home)
        await self.carry_pin(node, reply["cap"], home)
        handle.backup, node.cap = node.cap, reply["cap"]
        handle.backup_replica = home.addr
        handle.installed = reply["cap"]
        self._backups.add((home.addr, handle.backup))
        self.seen(node, reply)
        node.touch()
        await self.commit()

    async def carry_pin(self, node: Node, cap: str, link: PreddLink) -> None:
        """A pinned file's new cache (`cap` on `link`) is pinned before it is installed;
        if predd refuses, the new cache is freed and the file left as it was."""
        try:
            await self.policy.carry_pin(node, cap, link)
        except PreddError as exc:
            await self.free(cap, link.addr)
            raise fuse_error(exc) from None

    async def _truncate(self, node: Node, length: int) -> None:
        header, _ = await self.on_cache(node, "kv_truncate", length=length)
        self.seen(node, header)
        node.touch()
        await self.commit()

    async def truncate(self, node: Node, length: int) -> None:
        """truncate(2) to `length`: keep the cache's first `length` entries, in place
        (predd answers EINVAL past the cache's length)."""
        async with self.locks[node.ino]:
            await self._truncate(node, length)

    async def restore_backup(self, handle: Handle) -> None:
        """Garbage was written after a flush emptied the cache (a shell's `echo x > a.kv`
        closes a dup of the descriptor before it writes): put the cache back."""
        if handle.backup is not None:
            async with self.locks[handle.node.ino]:
                await self._restore_backup(handle)

    async def _restore_backup(self, handle: Handle) -> None:
        node, backup, replica = handle.node, handle.backup, handle.backup_replica
        if backup is None:
            return
        handle.backup = None
        self._backups.discard((replica, backup))
        if node.cap != handle.installed or node.replica != replica:
            await self.free(backup, replica)     # replaced since by another writer: theirs
            return
        old, node.cap = node.cap, backup
        try:
            self.seen(node, await self.link(node).call("kv_stat", cap=backup))
        except PreddError:
            pass
        node.touch()
        await self.commit()
        if old is not None:
            await self.free(old, replica)

    async def revoke(self, handle: Handle) -> None:
        """End an open's grant; remember it for the splice rule."""
        if handle.cap is not None:
            cap, handle.cap = handle.cap, None
            self._revoked[cap] = handle.node.ino
            while len(self._revoked) > REVOKED_KEPT:
                self._revoked.popitem(last=False)
            await self.free(cap, handle.replica)

    async def release(self, handle: Handle) -> None:
        """The open is gone: apply what it left pending, and whatever happens, revoke its
        grant and free the cache it kept."""
        node = handle.node
        try:
            if handle.pending:
                try:
                    await self.apply(handle)
                except Exception as exc:
                    why = (errno.errorcode.get(exc.errno, exc.errno)
                           if isinstance(exc, pyfuse3.FUSEError) else type(exc).__name__)
                    self.log(f"{self.ns.path_of(node.ino)}: write at release failed ({why})")
        finally:
            try:
                await self.revoke(handle)
                if handle.backup is not None:
                    self._backups.discard((handle.backup_replica, handle.backup))
                    await self.free(handle.backup, handle.backup_replica)
                    handle.backup = None
            finally:
                node.opens -= 1
                if node.opens == 0:
                    node.closed_at = time.monotonic()
                await self.maybe_free(node)

    async def release_all(self, handles: list[Handle]) -> None:
        """At unmount: revoke every open's grant (the kernel sends no release then) and
        free the caches of removed files that were still open."""
        caps: list[tuple[str, str | None]] = []
        for handle in handles:
            handle.node.opens -= 1
            caps += [(handle.replica, handle.cap), (handle.backup_replica, handle.backup)]
            self._backups.discard((handle.backup_replica, handle.backup))
        for replica, cap in caps:
            if cap is not None and self.replicas.known(replica):
                try:
                    await self.replicas.get(replica).call("kv_free", cap=cap, timeout=2.0)
                except PreddError:
                    pass
        for node in list(self.ns.nodes.values()):
            node.lookups = 0
            await self.maybe_free(node)

    async def snapshot(self, node: Node) -> None:
        """fsync: store the cache's export durably in the state directory."""
        async with self.locks[node.ino]:
            header, frames = await self.on_cache(node, "kv_export",
                                                 timeout=self.link(node).t.bulk_s)
            try:
                name = await trio.to_thread.run_sync(self.state.write_snapshot, node.ino,
                                                     bytes(frames[0] if frames else b""))
            except OSError as exc:
                self.log(f"fsync: cannot write snapshot: {exc}")
                raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
            node.snapshot = name
            self.seen(node, header)
            await self.commit()
