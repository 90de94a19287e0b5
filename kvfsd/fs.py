"""FUSE operations: each kernel request mapped onto the namespace and onto predd.

What a cache file means (see docs/kvfs.md):
* Each regular file holds one persistent predd capability (`Node.cap`, rw) to its KV
  object. Opening it for reading grants a fresh, session-bound capability (r, or rw
  when opened for writing too), rendered as the descriptor that `read` returns; the
  grant is revoked at release.
* Writing a descriptor into a file and closing it (what `cp` and `lip.kv_save` do)
  makes the file's cache a copy-on-write fork of the descriptor's object, at `flush`,
  so an error reaches close(2). Anything that is not a descriptor gets EINVAL and the
  file is left as it was. `O_TRUNC` (or truncate to 0) without a descriptor empties it.
* The cache is freed when the last name and the last open are gone.
* `fsync` stores a snapshot (kv_export) in the state directory, which `revalidate`
  imports again when predd has restarted. Caches without one are then dropped.
Files are served with direct_io: every open reads a different descriptor.
"""
from __future__ import annotations

import errno
import itertools
import os
import stat
from collections import defaultdict
from dataclasses import dataclass

import pyfuse3
import trio

from kvfsd.backend import Backend, PreddError
from kvfsd.namespace import COMPUTED_XATTRS, ROOT, Namespace, Node
from kvfsd.state import StateDir
from liblip import descriptor

ENTRY_TIMEOUT = 1.0
DIR_ATTR_TIMEOUT = 1.0
FILE_ATTR_TIMEOUT = 0.0      # st_blocks and mtime follow the cache as LIPs extend it
BLOCK = 512
MAGIC = descriptor.MAGIC.encode()
# A descriptor naming a capability predd does not know (forged, revoked, expired, or for
# a read-only use) is "not a valid descriptor".
BAD_DESCRIPTOR = ("EBADF", "ENOENT", "EINVAL", "EACCES")


def fuse_error(exc: Exception) -> pyfuse3.FUSEError:
    if isinstance(exc, PreddError | OSError):
        return pyfuse3.FUSEError(exc.errno or errno.EIO)
    return pyfuse3.FUSEError(errno.EIO)


@dataclass(eq=False)
class Handle:
    """One open of a cache file."""
    fh: int
    node: Node
    flags: int
    cap: str | None = None          # this open's grant (readable opens), revoked at release
    data: bytes = b""               # the descriptor this open reads
    written: bytearray | None = None
    truncate: bool = False          # O_TRUNC: empty the cache at flush, unless written
    backup: str | None = None       # the cache as it was before this open emptied it
    rejected: bool = False          # a non-descriptor was written: ignore the rest

    @property
    def readable(self) -> bool:
        return self.flags & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR)

    @property
    def writable(self) -> bool:
        return self.flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)

    def accept(self, off: int, buf: bytes) -> None:
        """Buffer a write; EINVAL as soon as it cannot be a descriptor."""
        if self.rejected:
            raise pyfuse3.FUSEError(errno.EINVAL)
        w = bytearray(self.written or b"")
        if self.flags & os.O_APPEND:
            off = len(w)
        if off > len(w):
            w.extend(b"\0" * (off - len(w)))
        w[off:off + len(buf)] = buf
        if len(w) > descriptor.MAX_LEN or not MAGIC.startswith(bytes(w[:len(MAGIC)])):
            self.rejected, self.written, self.truncate = True, None, False
            raise pyfuse3.FUSEError(errno.EINVAL)
        self.written = w

    @property
    def pending(self) -> bool:
        return bool(self.written) or self.truncate


class KvFs(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, ns: Namespace, state: StateDir, predd: Backend, log,
                 pending_free: list[str] | None = None) -> None:
        super().__init__()
        self.ns = ns
        self.state = state
        self.predd = predd
        self.log = log
        self.handles: dict[int, Handle] = {}
        self._fhs = itertools.count(1)
        self._locks: defaultdict[int, trio.Lock] = defaultdict(trio.Lock)
        # Read-only grants of released opens, kept until the file's last open is
        # released: the kernel's page cache may have served them to those opens.
        self._lingering: defaultdict[int, list[str]] = defaultdict(list)
        self._refreshing: dict[int, trio.Event] = {}    # kv_stat in flight, per inode
        self._revalidating = trio.Lock()
        self.generation = 0              # completed re-validations
        self.stale = False               # predd restarted and caches are not re-validated
        self.pending_free: list[str] = list(pending_free or [])

    # ------------------------------------------------------------ persistence

    def save(self, durable: bool = False) -> None:
        doc = self.ns.to_dict()
        # Caches of removed-but-open files are freed at release; should kvfsd die first,
        # the next one frees them.
        orphans = [n.cap for n in self.ns.nodes.values()
                   if n.is_file and n.nlink == 0 and n.cap is not None]
        doc["pending_free"] = self.pending_free + orphans
        self.state.save(doc, durable)

    # ------------------------------------------------------------ attributes

    def _size(self, node: Node) -> int:
        if node.is_file:
            model = self.predd.info.get("model", "")
            return len(descriptor.Descriptor("0" * 32, "r", node.tokens, node.pages,
                                             model).encode())
        if node.is_symlink:
            return len(node.target)
        return 4096

    def _attr(self, node: Node) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = node.ino
        a.generation = 0
        a.entry_timeout = ENTRY_TIMEOUT
        a.attr_timeout = FILE_ATTR_TIMEOUT if node.is_file else DIR_ATTR_TIMEOUT
        a.st_mode = node.mode
        a.st_nlink = node.nlink
        a.st_uid = node.uid
        a.st_gid = node.gid
        a.st_rdev = 0
        a.st_size = self._size(node)
        a.st_blksize = 4096
        a.st_blocks = -(-node.bytes // BLOCK) if node.is_file else 0
        a.st_atime_ns = node.atime_ns
        a.st_mtime_ns = node.mtime_ns
        a.st_ctime_ns = node.ctime_ns
        return a

    def _node(self, ino: int) -> Node:
        try:
            return self.ns.get(ino)
        except OSError as exc:
            raise fuse_error(exc) from None

    def _seen(self, node: Node, reply: dict) -> None:
        """Record predd's figures for a cache; mtime moves when its length changes."""
        tokens = int(reply.get("tokens", node.tokens))
        changed = tokens != node.tokens
        node.pages = int(reply.get("pages", node.pages))
        node.bytes = int(reply.get("bytes", node.bytes))
        if changed:
            node.tokens = tokens
            node.touch()
            self.save()

    # ------------------------------------------------------------ predd, per cache

    async def _on_cache(self, node: Node, op: str, **fields) -> tuple[dict, list]:
        """`op` on a file's cache. A stale capability (predd restarted) triggers one
        re-validation and a retry."""
        for attempt in (0, 1):
            cap = node.cap
            if cap is None:
                raise pyfuse3.FUSEError(errno.ESTALE)
            try:
                return await self.predd.request(op, cap=cap, **fields)
            except PreddError as exc:
                if exc.code == "EBADF" and attempt == 0:
                    await self.revalidate(self.generation, "a capability went stale")
                    continue
                raise fuse_error(exc) from None
        raise pyfuse3.FUSEError(errno.ESTALE)

    async def _refresh(self, node: Node, strict: bool = False) -> None:
        """Update a cache's figures from predd, waiting at most `stat_s`: predd answers
        a kv_stat only after the calls queued on that cache (a long generate), so past
        that the last-seen figures are used and the answer is applied when it comes.
        `strict`: EIO when predd is down (a stat itself never fails because of predd)."""
        if not node.is_file or node.cap is None:
            return
        if not self.predd.up:
            if strict:
                raise pyfuse3.FUSEError(errno.EIO)
            return
        done = self._refreshing.get(node.ino)
        if done is None:
            done = self._refreshing[node.ino] = trio.Event()
            trio.lowlevel.spawn_system_task(self._stat_in_background, node, done)
        with trio.move_on_after(self.predd.t.stat_s):
            await done.wait()

    async def _stat_in_background(self, node: Node, done: trio.Event) -> None:
        cap = node.cap
        try:
            header = await self.predd.call("kv_stat", cap=cap)
            if node.cap == cap:
                self._seen(node, header)
        except PreddError:
            pass
        except Exception as exc:    # a system task must not raise
            self.log(f"stat: {type(exc).__name__}: {exc}")
        finally:
            self._refreshing.pop(node.ino, None)
            done.set()

    async def _free_cap(self, cap: str) -> None:
        try:
            await self.predd.call("kv_free", cap=cap)
        except PreddError as exc:
            if exc.code != "EBADF":          # EBADF: already gone with a restarted predd
                self.pending_free.append(cap)
                self.save()

    async def _maybe_free(self, node: Node) -> None:
        """Free the cache of a file with no name and no open; drop the node when the
        kernel has forgotten it too."""
        if Namespace.cache_unreferenced(node) and node.cap is not None:
            cap, node.cap = node.cap, None
            if node.snapshot:
                self.state.remove_snapshot(node.snapshot)
                node.snapshot = None
            await self._free_cap(cap)
        if self.ns.collect(node):
            self._locks.pop(node.ino, None)

    # ------------------------------------------------------------ re-validation

    async def revalidate(self, seen_generation: int | None = None, why: str = "") -> bool:
        """Check every cache's capability with predd (after a predd restart, or at
        start). A stale one is re-imported from its fsync'd snapshot, or dropped with a
        log line. Returns False when predd could not be asked (try again later)."""
        async with self._revalidating:
            if seen_generation is not None and self.generation > seen_generation:
                return True                   # someone re-validated meanwhile
            if why:
                self.log(f"re-validating caches: {why}")
            for node in list(self.ns.files()):
                cap = node.cap
                if cap is not None:
                    try:
                        self._seen(node, await self.predd.call("kv_stat", cap=cap))
                        continue
                    except PreddError as exc:
                        if exc.code not in ("EBADF", "ENOENT"):
                            self.log(f"re-validation stopped: {exc.code}")
                            return False
                if node.cap != cap:
                    continue                  # replaced meanwhile: fresh
                await self._restore(node, cap)
            frees, self.pending_free = self.pending_free, []
            for cap in frees:
                await self._free_cap(cap)
            self.generation += 1
            self.save(durable=True)
            return True

    async def _restore(self, node: Node, stale: str | None) -> None:
        path = self.ns.path_of(node.ino)
        if node.snapshot:
            try:
                blob = await trio.to_thread.run_sync(self.state.read_snapshot, node.snapshot)
                reply = await self.predd.call("kv_import", frames=(blob,), persist=True,
                                              timeout=self.predd.t.bulk_s)
            except (OSError, PreddError) as exc:
                self.log(f"{path}: cannot restore its snapshot ({exc}); dropping it")
            else:
                if node.cap != stale:         # raced with a replacement: keep that
                    await self._free_cap(reply["cap"])
                    return
                node.cap = reply["cap"]
                node.tokens = int(reply["tokens"])
                self._seen(node, reply)
                self.log(f"{path}: restored from its fsync'd snapshot "
                         f"({node.tokens} tokens)")
                return
        else:
            self.log(f"{path}: cache lost (predd restarted and it was never fsync'd); "
                     "removing it")
        node.cap = None
        if node.snapshot:
            self.state.remove_snapshot(node.snapshot)
            node.snapshot = None
        for parent, name in self.ns.drop_names(node.ino):
            pyfuse3.invalidate_entry_async(parent, name, deleted=node.ino, ignore_enoent=True)
        self.ns.collect(node)

    async def monitor(self) -> None:
        """Follow predd: liveness, restarts (re-validate), deferred frees."""
        next_poll = 0.0
        while True:
            await self.predd.probe()
            if trio.current_time() >= next_poll:
                next_poll = trio.current_time() + self.predd.t.poll_s
                try:
                    await self.check_predd()
                except Exception as exc:   # never let the monitor die
                    self.log(f"monitor: {type(exc).__name__}: {exc}")
            await trio.sleep(self.predd.t.probe_s)

    async def check_predd(self) -> None:
        """Poll predd; re-validate after a restart (until one succeeds); retry frees."""
        first = self.predd.instance is None
        why = ""
        if await self.predd.poll():
            self.stale = True
            why = "first contact with predd" if first else "predd restarted"
        if self.predd.up and (self.stale or self.pending_free):
            if await self.revalidate(None, why if self.stale else ""):
                self.stale = False

    def remove_unused_snapshots(self) -> None:
        """Snapshots no inode refers to (a kvfsd that died mid-way left them)."""
        used = {n.snapshot for n in self.ns.nodes.values() if n.snapshot}
        for name in self.state.snapshot_names() - used:
            self.state.remove_snapshot(name)

    # ------------------------------------------------------------ lookups

    async def lookup(self, parent_inode, name, ctx):
        try:
            node = self.ns.lookup(parent_inode, name)
        except OSError as exc:
            raise fuse_error(exc) from None
        node.lookups += 1
        return self._attr(node)

    async def forget(self, inode_list):
        for ino, n in inode_list:
            node = self.ns.forget(ino, n)
            if node is not None and node.lookups == 0:
                try:
                    await self._maybe_free(node)
                except Exception as exc:   # forget must not raise
                    self.log(f"forget {ino}: {exc}")

    async def getattr(self, inode, ctx):
        node = self._node(inode)
        await self._refresh(node)
        return self._attr(node)

    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self._node(inode)
        if fields.update_size:
            if not node.is_file:
                raise pyfuse3.FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
            if attr.st_size == 0:
                async with self._locks[node.ino]:
                    header, _ = await self._on_cache(node, "kv_truncate", length=0)
                    self._seen(node, header)
                    node.touch()
                handle = self.handles.get(fh) if fh is not None else None
                if handle is not None:
                    handle.truncate = False
            elif attr.st_size != self._size(node):
                raise pyfuse3.FUSEError(errno.EINVAL)   # only emptying has a meaning
        try:
            if fields.update_mode:
                self.ns.chmod(node, attr.st_mode)
            if fields.update_uid or fields.update_gid:
                self.ns.chown(node, attr.st_uid if fields.update_uid else None,
                              attr.st_gid if fields.update_gid else None)
        except OSError as exc:
            raise fuse_error(exc) from None
        if fields.update_atime:
            node.atime_ns = attr.st_atime_ns
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        node.touch(mtime=False)
        self.save()
        return self._attr(node)

    async def readlink(self, inode, ctx):
        node = self._node(inode)
        if not node.is_symlink:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.target

    # ------------------------------------------------------------ directories

    async def opendir(self, inode, ctx):
        try:
            self.ns.dir(inode)
        except OSError as exc:
            raise fuse_error(exc) from None
        return inode

    async def readdir(self, fh, start_id, token):
        try:
            rows = self.ns.listdir(fh, start_id)
        except OSError:
            return
        for pos, name, node in rows:
            if not pyfuse3.readdir_reply(token, name, self._attr(node), pos):
                return
            if name not in (b".", b".."):
                node.lookups += 1

    async def releasedir(self, fh):
        pass

    async def fsyncdir(self, fh, datasync):
        self.save(durable=True)

    def _new_node(self, parent, name, mode, ctx, target=b"") -> Node:
        try:
            node = self.ns.add(parent, name, mode, ctx.uid, ctx.gid, target)
        except OSError as exc:
            raise fuse_error(exc) from None
        node.lookups += 1
        return node

    async def mkdir(self, parent_inode, name, mode, ctx):
        node = self._new_node(parent_inode, name,
                              stat.S_IFDIR | (mode & ~ctx.umask & 0o7777), ctx)
        self.save()
        return self._attr(node)

    async def symlink(self, parent_inode, name, target, ctx):
        node = self._new_node(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target)
        self.save()
        return self._attr(node)

    async def rmdir(self, parent_inode, name, ctx):
        try:
            node = self.ns.rmdir(parent_inode, name)
        except OSError as exc:
            raise fuse_error(exc) from None
        self.save()
        self.ns.collect(node)

    async def unlink(self, parent_inode, name, ctx):
        try:
            node = self.ns.unlink(parent_inode, name)
        except OSError as exc:
            raise fuse_error(exc) from None
        self.save()
        await self._maybe_free(node)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        try:
            displaced = self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                                       noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                                       exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))
        except OSError as exc:
            raise fuse_error(exc) from None
        self.save()
        if displaced is not None:
            await self._maybe_free(displaced)

    async def link(self, inode, new_parent_inode, new_name, ctx):
        try:
            node = self.ns.link(inode, new_parent_inode, new_name)
        except OSError as exc:
            raise fuse_error(exc) from None
        node.lookups += 1
        self.save()
        return self._attr(node)

    # ------------------------------------------------------------ creating caches

    async def _create_node(self, parent, name, mode, ctx) -> Node:
        try:
            self.ns.check_new(parent, name)
        except OSError as exc:
            raise fuse_error(exc) from None
        try:
            reply = await self.predd.call("kv_create", persist=True)
        except PreddError as exc:
            raise fuse_error(exc) from None
        try:
            node = self._new_node(parent, name, stat.S_IFREG | (mode & ~ctx.umask & 0o7777),
                                  ctx)
        except pyfuse3.FUSEError:
            await self._free_cap(reply["cap"])   # lost a race for the name
            raise
        node.cap = reply["cap"]
        self._seen(node, reply)
        self.save()
        return node

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not stat.S_ISREG(mode):
            raise pyfuse3.FUSEError(errno.EPERM)
        return self._attr(await self._create_node(parent_inode, name, mode, ctx))

    async def create(self, parent_inode, name, mode, flags, ctx):
        node = await self._create_node(parent_inode, name, mode, ctx)
        info = await self._open(node, flags)
        return info, self._attr(node)

    # ------------------------------------------------------------ open files

    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return await self._open(node, flags)

    async def _open(self, node: Node, flags: int) -> pyfuse3.FileInfo:
        handle = Handle(next(self._fhs), node, flags)
        if handle.readable:
            rights = "rw" if handle.writable else "r"
            header, _ = await self._on_cache(node, "kv_grant", rights=rights, persist=False)
            handle.cap = header["cap"]
            handle.data = descriptor.Descriptor(
                header["cap"], rights, int(header["tokens"]), int(header["pages"]),
                header.get("model", "")).encode()
            self._seen(node, header)
        if handle.writable and flags & os.O_TRUNC:
            if not self.predd.up:   # fail here, where the shell reports it
                raise pyfuse3.FUSEError(errno.EIO)
            handle.truncate = True
        self.handles[handle.fh] = handle
        node.opens += 1
        return pyfuse3.FileInfo(fh=handle.fh, direct_io=True, keep_cache=False)

    def _handle(self, fh: int) -> Handle:
        handle = self.handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return handle

    async def read(self, fh, off, size):
        handle = self._handle(fh)
        if handle.node.opens > 1:
            # This read may be filling the page cache (splice, mmap): drop it once the
            # reply is in, so a concurrent open is less likely to be served from it.
            trio.lowlevel.spawn_system_task(self._invalidate, handle.node.ino)
        return handle.data[off:off + size]

    async def _invalidate(self, ino: int) -> None:
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False)
        except Exception:   # the kernel may have forgotten the inode: nothing to drop
            pass

    async def write(self, fh, off, buf):
        handle = self._handle(fh)
        try:
            handle.accept(off, bytes(buf))
        except pyfuse3.FUSEError:
            await self._restore_backup(handle)
            raise
        return len(buf)

    async def _restore_backup(self, handle: Handle) -> None:
        """Garbage was written after a flush emptied the cache (a shell's
        `echo x > a.kv` closes a dup of the fd before writing): put the cache back."""
        node, backup = handle.node, handle.backup
        if backup is None:
            return
        handle.backup = None
        async with self._locks[node.ino]:
            old, node.cap = node.cap, backup
            try:
                self._seen(node, await self.predd.call("kv_stat", cap=backup))
            except PreddError:
                pass
            node.touch()
            self.save()
            if old is not None:
                await self._free_cap(old)

    async def flush(self, fh):
        await self._apply(self._handle(fh))

    async def _apply(self, handle: Handle) -> None:
        """Make what was written through `handle` take effect: a descriptor forks its
        object into this file; O_TRUNC with nothing written empties the cache."""
        node = handle.node
        async with self._locks[node.ino]:
            if handle.written:
                data, handle.written, handle.truncate = bytes(handle.written), None, False
                try:
                    desc = descriptor.parse(data)
                except ValueError:
                    raise pyfuse3.FUSEError(errno.EINVAL) from None
                model = self.predd.info.get("model")
                if desc.model and model and desc.model != model:
                    raise pyfuse3.FUSEError(errno.EINVAL)
                try:
                    reply = await self.predd.call("kv_fork", cap=desc.cap, rights="rw",
                                                  persist=True)
                except PreddError as exc:
                    if exc.code in BAD_DESCRIPTOR:
                        self.log(f"{self.ns.path_of(node.ino)}: descriptor refused: {exc}")
                        raise pyfuse3.FUSEError(errno.EINVAL) from None
                    raise fuse_error(exc) from None
                old, node.cap = node.cap, reply["cap"]
                self._seen(node, reply)
                node.touch()
                self.save()
                if old is not None:
                    await self._free_cap(old)
            elif handle.truncate:
                # Keep an O(1) fork of the cache until release, in case garbage follows.
                if handle.backup is None:
                    header, _ = await self._on_cache(node, "kv_fork", rights="rw", persist=True)
                    handle.backup = header["cap"]
                header, _ = await self._on_cache(node, "kv_truncate", length=0)
                handle.truncate = False
                self._seen(node, header)
                node.touch()
                self.save()

    async def release(self, fh):
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        node = handle.node
        try:
            if handle.pending:
                try:
                    await self._apply(handle)
                except pyfuse3.FUSEError as exc:
                    self.log(f"{self.ns.path_of(node.ino)}: write at release failed "
                             f"({errno.errorcode.get(exc.errno, exc.errno)})")
            if handle.cap is not None and not handle.writable and node.opens > 1:
                self._lingering[node.ino].append(handle.cap)
            elif handle.cap is not None:
                await self._free_cap(handle.cap)
            if handle.backup is not None:
                await self._free_cap(handle.backup)
        finally:
            node.opens -= 1
            if node.opens == 0:
                for cap in self._lingering.pop(node.ino, []):
                    await self._free_cap(cap)
            await self._maybe_free(node)

    async def fsync(self, fh, datasync):
        handle = self._handle(fh)
        if handle.pending:
            await self._apply(handle)
        node = handle.node
        async with self._locks[node.ino]:
            header, frames = await self._on_cache(node, "kv_export",
                                                  timeout=self.predd.t.bulk_s)
            blob = frames[0] if frames else b""
            try:
                name = await trio.to_thread.run_sync(self.state.write_snapshot, node.ino,
                                                     bytes(blob))
            except OSError as exc:
                self.log(f"fsync: cannot write snapshot: {exc}")
                raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
            node.snapshot = name
            self._seen(node, header)
            self.save(durable=True)

    # ------------------------------------------------------------ file system

    async def statfs(self, ctx):
        if self.predd.up:
            try:
                self.predd.stats = await self.predd.call("stats", timeout=2.0)
            except PreddError:
                pass
        s = pyfuse3.StatvfsData()
        page_bytes = int(self.predd.info.get("bytes_per_page", 0)) or 4096
        s.f_bsize = s.f_frsize = page_bytes
        s.f_blocks = int(self.predd.stats.get("pages_total", 0))
        s.f_bfree = s.f_bavail = int(self.predd.stats.get("pages_free", 0))
        s.f_files = 1 << 32
        s.f_ffree = s.f_favail = s.f_files - len(self.ns)
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------ xattrs

    async def getxattr(self, inode, name, ctx):
        node = self._node(inode)
        if node.is_file and name in COMPUTED_XATTRS:
            await self._refresh(node, strict=True)
            return str(self._computed(node, name)).encode()
        try:
            return self.ns.getxattr(node, name)
        except OSError as exc:
            raise fuse_error(exc) from None

    def _computed(self, node: Node, name: bytes):
        info = self.predd.info
        return {b"user.kv.tokens": node.tokens, b"user.kv.bytes": node.bytes,
                b"user.kv.pages": node.pages, b"user.kv.model": info.get("model", ""),
                b"user.kv.tier": info.get("device", "")}[name]

    async def listxattr(self, inode, ctx):
        node = self._node(inode)
        return (list(COMPUTED_XATTRS) if node.is_file else []) + list(node.xattrs)

    async def setxattr(self, inode, name, value, ctx):
        node = self._node(inode)
        try:
            self.ns.setxattr(node, name, value)
        except OSError as exc:
            raise fuse_error(exc) from None
        self.save()

    async def removexattr(self, inode, name, ctx):
        node = self._node(inode)
        try:
            self.ns.removexattr(node, name)
        except OSError as exc:
            raise fuse_error(exc) from None
        self.save()

    # ------------------------------------------------------------ start / stop

    def open_count(self) -> int:
        return len(self.handles)

    async def release_all(self) -> None:
        """At unmount: revoke every open's grant (the kernel sends no release then)."""
        lingering = [cap for caps in self._lingering.values() for cap in caps]
        self._lingering.clear()
        for fh in list(self.handles):
            handle = self.handles.pop(fh)
            handle.node.opens -= 1
            lingering += [handle.cap, handle.backup]
        for cap in lingering:
            if cap is not None:
                try:
                    await self.predd.call("kv_free", cap=cap, timeout=2.0)
                except PreddError:
                    pass
        for node in list(self.ns.nodes.values()):
            if node.ino != ROOT:
                node.lookups = 0
                await self._maybe_free(node)
