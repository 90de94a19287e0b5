"""FUSE operations: each kernel request mapped onto the namespace and the caches.

What the calls mean (see docs/kvfs.md):
* A regular file is a KV cache. Opening it for reading grants a fresh capability,
  rendered as the descriptor `read` returns (served with direct_io: every open reads a
  different one).
* Writing a descriptor into a file and closing it (`cp`, `lip.kv_save`) makes the file's
  cache a copy-on-write fork of the descriptor's, at `flush`, so an error reaches
  close(2). Anything else gets EINVAL (EFBIG past 4096 bytes) and the file is left as
  it was. `O_TRUNC` without a descriptor empties it; truncate(2) to N keeps the
  cache's first N entries (EINVAL past its length), while `st_size` stays the
  descriptor's length.
* `fsync` writes a snapshot into the state directory.
* `user.kv.pin` and `user.kv.evict` are carried out by predd (kvfsd/policy.py),
  `user.kv.ttl` by kvfsd's timer (kvfsd/expiry.py), `user.kv.rehome` by
  kvfsd/migration.py. The mount root's `user.kv.replicas` and `user.kv.migrations`
  tell how the replicas stand.
Namespace-only calls (mkdir, rename, chmod, other xattrs...) never wait for predd.

Every handler goes through `errno_boundary`: whatever one request raises becomes an
errno for that request alone (unexpected exceptions: EIO and a log line), so no input
can stop the daemon. New files and directories are private (`PRIVATE_MASK`) until
their owner chmods them; objects made for a request are charged to its uid (`owner`).
"""
from __future__ import annotations

import errno
import functools
import itertools
import os
import stat
import traceback
from collections import Counter

import pyfuse3
import trio

from kvfsd import xattrs
from kvfsd.caches import Caches, fuse_error
from kvfsd.handles import Handle
from kvfsd.namespace import Namespace
from kvfsd.node import ROOT, Node
from kvfsd.predd_link import PreddError
from symphony_protocol import descriptor
ENTRY_TIMEOUT = 1.0
DIR_ATTR_TIMEOUT = 1.0
FILE_ATTR_TIMEOUT = 0.0      # st_blocks and mtime follow the cache as LIPs extend it
BLOCK = 512
PRIVATE_MASK = 0o077      # new files 0600, new directories 0700 (then chmod as wanted)


def errno_boundary(fn):
    """Wrap a FUSE handler: a FUSEError passes, OSError and predd errors become their
    errno, anything else EIO with a log line (where, never the message: it could hold a
    capability). Cancellation (BaseException) still propagates."""
    @functools.wraps(fn)
    async def handler(self, *args):
        try:
            return await fn(self, *args)
        except pyfuse3.FUSEError:
            raise
        except (OSError, PreddError) as exc:
            raise fuse_error(exc) from None
        except Exception as exc:
            self.log(f"{fn.__name__}: {_where(exc)}; answered EIO")
            raise pyfuse3.FUSEError(errno.EIO) from None
    return handler


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"unexpected {type(exc).__name__}{at}"


class KvFs(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, caches: Caches) -> None:
        super().__init__()
        self.caches = caches
        self.ns: Namespace = caches.ns
        self.predd = caches.predd
        self.log = caches.log
        self.handles: dict[int, Handle] = caches.handles
        self._fhs = itertools.count(1)

    async def commit(self) -> None:
        """Record the namespace change just made in the state directory."""
        await self.caches.commit()

    # ------------------------------------------------------------ attributes

    def _size(self, node: Node) -> int:
        if node.is_file:
            info = self.caches.link(node).info or self.predd.info   # all serve one model
            model = str(info.get("model", ""))
            return len(descriptor.render("0" * 32, "r", node.tokens, node.pages,
                                         model, node.replica).encode())
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
        return self.ns.get(ino)

    def _handle(self, fh: int) -> Handle:
        handle = self.handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return handle

    # ------------------------------------------------------------ lookups and attributes

    @errno_boundary
    async def lookup(self, parent_inode, name, ctx):
        node = self.ns.lookup(parent_inode, name)
        node.lookups += 1
        return self._attr(node)

    async def forget(self, inode_list):
        # No reply to send: nothing may escape, whatever happens.
        for ino, n in inode_list:
            try:
                node = self.ns.forget(ino, n)
                if node is not None and node.lookups == 0:
                    await self.caches.maybe_free(node)
            except Exception as exc:
                self.log(f"forget {ino}: {_where(exc)}")

    @errno_boundary
    async def getattr(self, inode, ctx):
        node = self._node(inode)
        await self.caches.refresh(node)
        return self._attr(node)

    @errno_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self._node(inode)
        if fields.update_size:
            if not node.is_file:
                raise pyfuse3.FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
            # st_size counts entries here, not descriptor bytes: keep the first N.
            await self.caches.truncate(node, attr.st_size)
            if attr.st_size == 0 and fh in self.handles:
                self.handles[fh].truncate = False     # an O_TRUNC open: emptied already
        if fields.update_mode:
            self.ns.chmod(node, attr.st_mode)
        if fields.update_uid or fields.update_gid:
            self.ns.chown(node, attr.st_uid if fields.update_uid else None,
                          attr.st_gid if fields.update_gid else None)
        if fields.update_atime:
            node.atime_ns = attr.st_atime_ns
        if fields.update_mtime:
            node.mtime_ns = attr.st_mtime_ns
        node.touch(mtime=False)
        await self.commit()
        return self._attr(node)

    @errno_boundary
    async def readlink(self, inode, ctx):
        node = self._node(inode)
        if not node.is_symlink:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return node.target

    @errno_boundary
    async def statfs(self, ctx):
        """The KV pools of the live replicas together (none live: the last figures
        seen of all)."""
        links = self.caches.replicas.links
        for link in links:
            if link.up:
                try:
                    link.stats = await link.call("stats", timeout=2.0)
                except PreddError:
                    pass                   # the last figures seen
        counted = [link for link in links if link.up] or links
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = int(counted[0].info.get("bytes_per_page", 0)) or 4096
        s.f_blocks = sum(int(link.stats.get("pages_total", 0)) for link in counted)
        s.f_bfree = s.f_bavail = sum(int(link.stats.get("pages_free", 0))
                                     for link in counted)
        s.f_files = 1 << 32
        s.f_ffree = s.f_favail = s.f_files - len(self.ns)
        s.f_namemax = 255
        return s

    # ------------------------------------------------------------ directories

    @errno_boundary
    async def opendir(self, inode, ctx):
        self.ns.dir(inode)
        return inode

    @errno_boundary
    async def readdir(self, fh, start_id, token):
        for pos, name, node in self.ns.listdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._attr(node), pos):
                return
            if name not in (b".", b".."):
                node.lookups += 1

    @errno_boundary
    async def releasedir(self, fh):
        pass

    @errno_boundary
    async def fsyncdir(self, fh, datasync):
        await self.commit()

    def _new_node(self, parent, name, mode, ctx, target=b"") -> Node:
        node = self.ns.add(parent, name, mode, ctx.uid, ctx.gid, target)
        node.lookups += 1
        return node

    @errno_boundary
    async def mkdir(self, parent_inode, name, mode, ctx):
        node = self._new_node(parent_inode, name, stat.S_IFDIR | _new_mode(mode, ctx), ctx)
        await self.commit()
        return self._attr(node)

    @errno_boundary
    async def symlink(self, parent_inode, name, target, ctx):
        node = self._new_node(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target)
        await self.commit()
        return self._attr(node)

    @errno_boundary
    async def rmdir(self, parent_inode, name, ctx):
        node = self.ns.rmdir(parent_inode, name)
        await self.commit()
        self.ns.collect(node)

    @errno_boundary
    async def unlink(self, parent_inode, name, ctx):
        node = self.ns.unlink(parent_inode, name)
        await self.commit()
        await self.caches.maybe_free(node)

    @errno_boundary
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        displaced = self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                                   noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                                   exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))
        await self.commit()
        if displaced is not None:
            await self.caches.maybe_free(displaced)

    @errno_boundary
    async def link(self, inode, new_parent_inode, new_name, ctx):
        node = self.ns.link(inode, new_parent_inode, new_name)
        node.lookups += 1
        await self.commit()
        return self._attr(node)

    # ------------------------------------------------------------ cache files

    async def _create_node(self, parent, name, mode, ctx) -> Node:
        self.ns.check_new(parent, name, ctx.uid)          # before predd makes anything
        reply = await self.caches.create(owner=ctx.uid)
        try:
            node = self._new_node(parent, name, stat.S_IFREG | _new_mode(mode, ctx), ctx)
        except OSError:
            await self.caches.free(reply["cap"], reply["replica"])   # lost a race for the name
            raise
        node.cap, node.replica = reply["cap"], reply.get("replica", "")
        self.caches.seen(node, reply)
        await self.commit()
        return node

    @errno_boundary
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not stat.S_ISREG(mode):
            raise pyfuse3.FUSEError(errno.EPERM)
        return self._attr(await self._create_node(parent_inode, name, mode, ctx))

    @errno_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        node = await self._create_node(parent_inode, name, mode, ctx)
        return await self._open(node, flags, ctx), self._attr(node)

    @errno_boundary
    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return await self._open(node, flags, ctx)

    async def _open(self, node: Node, flags: int, ctx) -> pyfuse3.FileInfo:
        if not node.is_file:
            raise pyfuse3.FUSEError(errno.EINVAL)
        handle = Handle(next(self._fhs), node, flags, uid=ctx.uid)
        if handle.readable:
            await self.caches.grant(handle)
        if handle.writable and flags & os.O_TRUNC:
            if not self.caches.link(node).up:   # fail here, where the shell reports it
                await self.caches.revoke(handle)
                raise pyfuse3.FUSEError(errno.EIO)
            handle.truncate = True
        self.handles[handle.fh] = handle
        node.opens += 1
        return pyfuse3.FileInfo(fh=handle.fh, direct_io=True, keep_cache=False)

    @errno_boundary
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

    @errno_boundary
    async def write(self, fh, off, buf):
        handle = self._handle(fh)
        try:
            handle.accept(off, buf)
        except pyfuse3.FUSEError:
            await self.caches.restore_backup(handle)
            raise
        return len(buf)

    @errno_boundary
    async def flush(self, fh):
        await self.caches.apply(self._handle(fh))

    @errno_boundary
    async def release(self, fh):
        handle = self.handles.pop(fh, None)
        if handle is not None:
            await self.caches.release(handle)

    @errno_boundary
    async def fsync(self, fh, datasync):
        handle = self._handle(fh)
        if handle.pending:
            await self.caches.apply(handle)
        await self.caches.snapshot(handle.node)

    async def release_all(self) -> None:
        handles = list(self.handles.values())
        self.handles.clear()
        await self.caches.release_all(handles)

    # ------------------------------------------------------------ xattrs

    @errno_boundary
    async def getxattr(self, inode, name, ctx):
        node = self._node(inode)
        if node.is_file and name == xattrs.REPLICA:
            return node.replica.encode()           # kvfsd's own: predd is not asked
        if node.is_file and name in xattrs.COMPUTED:
            await self.caches.refresh(node, strict=True)
            info = self.caches.link(node).info
            value = {b"user.kv.tokens": node.tokens, b"user.kv.bytes": node.bytes,
                     b"user.kv.pages": node.pages, b"user.kv.model": info.get("model", ""),
                     b"user.kv.tier": node.tier or "device"}[name]
            return str(value).encode()
        if node.ino == ROOT and name == xattrs.REPLICAS:
            files = Counter(n.replica for n in self.ns.files())   # a walk: rarely asked
            return self.caches.replicas.report(files).encode()
        if node.ino == ROOT and name == xattrs.MIGRATIONS:
            replicas = self.caches.replicas
            return f"{replicas.migrations} {replicas.migrated_bytes}".encode()
        return self.ns.getxattr(node, name)

    @errno_boundary
    async def listxattr(self, inode, ctx):
        node = self._node(inode)
        computed = (list(xattrs.COMPUTED) if node.is_file
                    else list(xattrs.ROOT_COMPUTED) if node.ino == ROOT else [])
        return computed + list(node.xattrs)

    @errno_boundary
    async def setxattr(self, inode, name, value, ctx):
        node = self._node(inode)
        xattrs.check(name, value)
        xattrs.check_room(node.xattrs, name, node.is_file)
        if name == xattrs.EVICT:
            await self.caches.policy.evict(node)      # an action: nothing is stored
            return
        if name == xattrs.REHOME:
            await self.caches.migration.rehome(node, value, ctx.uid)   # an action too
            return
        if name == xattrs.PIN:                        # predd first: a refusal stores nothing
            await self.caches.policy.set_pin(node, value)
        else:
            self.ns.setxattr(node, name, value)
        if name == xattrs.TTL:
            self.caches.expiry.watch(node)
        await self.commit()

    @errno_boundary
    async def removexattr(self, inode, name, ctx):
        node = self._node(inode)
        if name == xattrs.PIN and name in node.xattrs:
            await self.caches.policy.set_pin(node, None)
        else:
            self.ns.removexattr(node, name)
        await self.commit()


def _new_mode(mode: int, ctx) -> int:
    """Permission bits of a new file or directory: the creator's umask, and private."""
    return mode & ~ctx.umask & ~PRIVATE_MASK & 0o7777
