"""FUSE operations: each kernel request mapped onto the namespace and the caches.

What the calls mean (see docs/kvfs.md):
* A regular file is a KV cache. Opening it for reading grants a fresh capability,
  rendered as the descriptor `read` returns (served with direct_io: every open reads a
  different one).
* Writing a descriptor into a file and closing it (`cp`, `lip.kv_save`) makes the file's
  cache a copy-on-write fork of the descriptor's, at `flush`, so an error reaches
  close(2). Anything else gets EINVAL and the file is left as it was. `O_TRUNC`
  without a descriptor, or truncate(2) to 0, empties it.
* `fsync` writes a snapshot into the state directory.
Namespace-only calls (mkdir, rename, chmod, xattrs...) never wait for predd.
"""
from __future__ import annotations

import errno
import itertools
import os
import stat

import pyfuse3
import trio

from kvfsd.caches import Caches, fuse_error
from kvfsd.handles import Handle
from kvfsd.namespace import COMPUTED_XATTRS, Namespace, Node
from liblip import descriptor

ENTRY_TIMEOUT = 1.0
DIR_ATTR_TIMEOUT = 1.0
FILE_ATTR_TIMEOUT = 0.0      # st_blocks and mtime follow the cache as LIPs extend it
BLOCK = 512


class KvFs(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False

    def __init__(self, caches: Caches) -> None:
        super().__init__()
        self.caches = caches
        self.ns: Namespace = caches.ns
        self.predd = caches.predd
        self.log = caches.log
        self.handles: dict[int, Handle] = {}
        self._fhs = itertools.count(1)

    def save(self) -> None:
        self.caches.save()

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

    def _handle(self, fh: int) -> Handle:
        handle = self.handles.get(fh)
        if handle is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        return handle

    # ------------------------------------------------------------ lookups and attributes

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
                    await self.caches.maybe_free(node)
                except Exception as exc:   # forget must not raise
                    self.log(f"forget {ino}: {exc}")

    async def getattr(self, inode, ctx):
        node = self._node(inode)
        await self.caches.refresh(node)
        return self._attr(node)

    async def setattr(self, inode, attr, fields, fh, ctx):
        node = self._node(inode)
        if fields.update_size:
            if not node.is_file:
                raise pyfuse3.FUSEError(errno.EISDIR if node.is_dir else errno.EINVAL)
            if attr.st_size == 0:
                await self.caches.empty(node)
                if fh in self.handles:
                    self.handles[fh].truncate = False
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

    async def statfs(self, ctx):
        if self.predd.up:
            try:
                self.predd.stats = await self.predd.call("stats", timeout=2.0)
            except Exception:
                pass                       # the last figures seen
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = int(self.predd.info.get("bytes_per_page", 0)) or 4096
        s.f_blocks = int(self.predd.stats.get("pages_total", 0))
        s.f_bfree = s.f_bavail = int(self.predd.stats.get("pages_free", 0))
        s.f_files = 1 << 32
        s.f_ffree = s.f_favail = s.f_files - len(self.ns)
        s.f_namemax = 255
        return s

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
        self.caches.save(durable=True)

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
        await self.caches.maybe_free(node)

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        try:
            displaced = self.ns.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                                       noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                                       exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))
        except OSError as exc:
            raise fuse_error(exc) from None
        self.save()
        if displaced is not None:
            await self.caches.maybe_free(displaced)

    async def link(self, inode, new_parent_inode, new_name, ctx):
        try:
            node = self.ns.link(inode, new_parent_inode, new_name)
        except OSError as exc:
            raise fuse_error(exc) from None
        node.lookups += 1
        self.save()
        return self._attr(node)

    # ------------------------------------------------------------ cache files

    async def _create_node(self, parent, name, mode, ctx) -> Node:
        try:
            self.ns.check_new(parent, name)
        except OSError as exc:
            raise fuse_error(exc) from None
        reply = await self.caches.create()
        try:
            node = self._new_node(parent, name, stat.S_IFREG | (mode & ~ctx.umask & 0o7777),
                                  ctx)
        except pyfuse3.FUSEError:
            await self.caches.free(reply["cap"])     # lost a race for the name
            raise
        node.cap = reply["cap"]
        self.caches.seen(node, reply)
        self.save()
        return node

    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        if not stat.S_ISREG(mode):
            raise pyfuse3.FUSEError(errno.EPERM)
        return self._attr(await self._create_node(parent_inode, name, mode, ctx))

    async def create(self, parent_inode, name, mode, flags, ctx):
        node = await self._create_node(parent_inode, name, mode, ctx)
        return await self._open(node, flags), self._attr(node)

    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return await self._open(node, flags)

    async def _open(self, node: Node, flags: int) -> pyfuse3.FileInfo:
        handle = Handle(next(self._fhs), node, flags)
        if handle.readable:
            await self.caches.grant(handle)
        if handle.writable and flags & os.O_TRUNC:
            if not self.predd.up:   # fail here, where the shell reports it
                raise pyfuse3.FUSEError(errno.EIO)
            handle.truncate = True
        self.handles[handle.fh] = handle
        node.opens += 1
        return pyfuse3.FileInfo(fh=handle.fh, direct_io=True, keep_cache=False)

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
            await self.caches.restore_backup(handle)
            raise
        return len(buf)

    async def flush(self, fh):
        await self.caches.apply(self._handle(fh))

    async def release(self, fh):
        handle = self.handles.pop(fh, None)
        if handle is not None:
            await self.caches.release(handle)

    async def fsync(self, fh, datasync):
        handle = self._handle(fh)
        if handle.pending:
            await self.caches.apply(handle)
        await self.caches.snapshot(handle.node)

    async def release_all(self) -> None:
        handles, self.handles = list(self.handles.values()), {}
        await self.caches.release_all(handles)

    # ------------------------------------------------------------ xattrs

    async def getxattr(self, inode, name, ctx):
        node = self._node(inode)
        if node.is_file and name in COMPUTED_XATTRS:
            await self.caches.refresh(node, strict=True)
            info = self.predd.info
            value = {b"user.kv.tokens": node.tokens, b"user.kv.bytes": node.bytes,
                     b"user.kv.pages": node.pages, b"user.kv.model": info.get("model", ""),
                     b"user.kv.tier": info.get("device", "")}[name]
            return str(value).encode()
        try:
            return self.ns.getxattr(node, name)
        except OSError as exc:
            raise fuse_error(exc) from None

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
