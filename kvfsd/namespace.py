"""The file-system namespace: inodes, names, directories, owners, modes, times, xattrs.

Pure bookkeeping — no FUSE, no predd, no I/O — so it is unit-tested on its own. Errors
are `OSError(errno)`; the FUSE layer turns them into replies.

Lifetime rules (POSIX):
* A file node's `nlink` counts its names; a directory's is 2 + its subdirectories.
* A file's KV cache (`cap`, a persistent predd capability) is freed by the FUSE layer
  when the last name *and* the last open are gone (`cache_unreferenced`).
* The node itself is dropped when, in addition, the kernel no longer knows it
  (`lookups == 0`, `collectable`); until then `getattr` on it still answers.
* `lookups` and `opens` are runtime state: they are never persisted. Only linked nodes
  (reachable from the root) are written to the state directory.

Changes are journaled for incremental persistence: assigning any persisted field of a
node marks it dirty (`Node.__setattr__`), and every change to a directory's entries
marks that (directory, name) dirty; `take_changes` hands both over, so the state
directory is written in O(changes), never O(namespace). In-place changes to `xattrs`
and `entries` are always followed by `touch()`, which marks the node too.

Bounds (what one local user can make kvfsd hold): every name is charged to the uid
owning the node it names (a file with three links costs three); a uid other than 0
holding `names_per_uid` names gets EDQUOT. In `user.kv.*` only `pin` and `ttl` may be
set (files only); a node may also carry a few short application attributes of its own
(see kvfsd/xattrs.py). So a node's state is bounded, and with it a uid's.
"""
from __future__ import annotations

import errno
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from kvfsd import xattrs
from kvfsd.listing import Listing
from kvfsd.node import ROOT, Node, node_from_dict, node_row, node_to_dict, now_ns, show

NAME_MAX = 255
ROOT_MODE = stat.S_IFDIR | 0o1777
FORMAT = 1

NAMES_PER_UID = 4096           # default bound on the names one uid may own (0: none)


@dataclass
class Changes:
    """What changed since the last `take_changes`: node rows to write (`rows`, JSON-able,
    without entries), inodes no longer linked (`gone`), directory entries as
    (directory, name, inode or None when removed, readdir position), and every inode
    touched (`inos`)."""
    rows: list[dict]
    gone: list[int]
    entries: list[tuple[int, bytes, int | None, int | None]]
    inos: set[int]

    def __bool__(self) -> bool:
        return bool(self.inos or self.entries)


def _err(code: int, what: str = "") -> OSError:
    return OSError(code, f"{errno.errorcode[code]}{': ' if what else ''}{what}")


def _check_length(name: bytes) -> None:
    """ENAMETOOLONG for a name longer than any name here may be."""
    if len(name) > NAME_MAX:
        raise _err(errno.ENAMETOOLONG)


class Namespace:
    def __init__(self, root_uid: int = 0, root_gid: int = 0,
                 names_per_uid: int = NAMES_PER_UID) -> None:
        t = now_ns()
        root = Node(ROOT, ROOT_MODE, root_uid, root_gid, t, t, t, nlink=2,
                    entries={}, order=Listing(), parent=ROOT)
        self.nodes: dict[int, Node] = {}
        self.next_ino = ROOT + 1
        self.names_per_uid = names_per_uid
        self.names_of_uid: Counter[int] = Counter()   # names charged to each uid
        self.dirty: set[int] = set()                        # journal: inodes ...
        self.dirty_entries: set[tuple[int, bytes]] = set()  # ... and directory entries
        # caches of unreachable nodes dropped at load: (replica, capability)
        self.lost_caps: list[tuple[str, str]] = []
        self._adopt(root)

    def _adopt(self, node: Node) -> None:
        self.nodes[node.ino] = node
        node.journal = self.dirty
        self.dirty.add(node.ino)

    # ------------------------------------------------------------ lookups

    def __len__(self) -> int:
        return len(self.nodes)

    def get(self, ino: int) -> Node:
        node = self.nodes.get(ino)
        if node is None:
            raise _err(errno.ENOENT, f"inode {ino}")
        return node

    def dir(self, ino: int) -> Node:
        node = self.get(ino)
        if not node.is_dir:
            raise _err(errno.ENOTDIR)
        return node

    def lookup(self, parent: int, name: bytes) -> Node:
        d = self.dir(parent)
        if name == b".":
            return d
        if name == b"..":
            return self.get(d.parent)
        _check_length(name)               # no such name can exist (tmpfs and ext4 say so)
        ino = d.entries.get(name)
        if ino is None:
            raise _err(errno.ENOENT, show(name))
        return self.nodes[ino]

    def listdir(self, ino: int, after: int = 0) -> Iterator[tuple[int, bytes, Node]]:
        """(position, name, node) of the entries past `after`, in a stable order, with
        "." and ".." at positions 1 and 2. Lazy: a readdir batch costs what it
        returns (kvfsd/listing.py), never a walk or a sort of the whole directory. Do not
        change the directory while iterating."""
        d = self.dir(ino)
        if after < 1:
            yield 1, b".", d
        if after < 2:
            yield 2, b"..", self.get(d.parent)
        for pos, name in d.order.after(after):
            yield pos, name, self.nodes[d.entries[name]]

    def files(self) -> Iterator[Node]:
        """Linked cache files (a walk of the whole namespace: for start-up and
        re-validation after a predd restart, never for one request)."""
        return (n for n in list(self.nodes.values()) if n.is_file and n.nlink > 0)

    def names_of(self, ino: int) -> list[tuple[int, bytes]]:
        """(directory, name) pairs under which `ino` is linked."""
        node = self.nodes.get(ino)
        return list(node.links) if node is not None else []

    def path_of(self, ino: int) -> str:
        """One path of a node, for log lines ("/a/b.kv"; "?" if unlinked)."""
        parts = []
        node = self.nodes.get(ino)
        while node is not None and node.ino != ROOT:
            if not node.links:
                return "?"
            parent, name = next(iter(node.links))      # a directory has one name
            parts.append(show(name))
            node = self.nodes.get(parent)
        return "/" + "/".join(reversed(parts))

    # ------------------------------------------------------------ creating

    def _check_new(self, d: Node, name: bytes) -> None:
        if not name or b"/" in name or name in (b".", b".."):
            raise _err(errno.EINVAL, "bad name")
        _check_length(name)
        if name in d.entries:
            raise _err(errno.EEXIST, show(name))

    def check_new(self, parent: int, name: bytes, uid: int | None = None) -> None:
        """EINVAL/ENAMETOOLONG/EEXIST for a bad name, EDQUOT when `uid` may not own one
        more name: what `add` would refuse, checked before predd is asked for a cache."""
        self._check_new(self.dir(parent), name)
        if uid is not None:
            self._check_quota(uid)

    def _check_quota(self, uid: int) -> None:
        limit = self.names_per_uid
        if limit and uid != 0 and self.names_of_uid[uid] >= limit:
            raise _err(errno.EDQUOT, f"uid {uid} owns {limit} names already")

    def _charge(self, node: Node, n: int) -> None:
        self.names_of_uid[node.uid] += n
        if self.names_of_uid[node.uid] <= 0:
            del self.names_of_uid[node.uid]

    def _insert(self, d: Node, name: bytes, node: Node) -> None:
        d.entries[name] = node.ino
        d.order.add(name)
        node.links[d.ino, name] = None
        self.dirty_entries.add((d.ino, name))
        d.touch()

    def _remove_entry(self, d: Node, name: bytes) -> Node:
        """Take `name` out of directory `d` (its node's counts are the caller's)."""
        node = self.nodes[d.entries.pop(name)]
        d.order.remove(name)
        del node.links[d.ino, name]
        self.dirty_entries.add((d.ino, name))
        return node

    def add(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
            target: bytes = b"") -> Node:
        """A new file, directory or symlink `name` in `parent` (mode includes the type)."""
        d = self.dir(parent)
        self._check_new(d, name)
        self._check_quota(uid)
        kind = stat.S_IFMT(mode)
        if kind not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
            raise _err(errno.EPERM, "only files, directories and symlinks")
        perm = 0o777 if kind == stat.S_IFLNK else mode & 0o7777
        if d.mode & stat.S_ISGID:   # BSD group semantics of a setgid directory
            gid = d.gid
            if kind == stat.S_IFDIR:
                perm |= stat.S_ISGID
        t = now_ns()
        node = Node(self.next_ino, kind | perm, uid, gid, t, t, t, nlink=1, target=target)
        self.next_ino += 1
        if kind == stat.S_IFDIR:
            node.nlink, node.entries, node.order, node.parent = 2, {}, Listing(), d.ino
            d.nlink += 1
        self._adopt(node)
        self._insert(d, name, node)
        self._charge(node, 1)
        return node

    def link(self, ino: int, parent: int, name: bytes) -> Node:
        node = self.get(ino)
        if node.is_dir:
            raise _err(errno.EPERM, "hard link to a directory")
        if node.nlink == 0:
            raise _err(errno.ENOENT, "file was removed")
        d = self.dir(parent)
        self._check_new(d, name)
        self._check_quota(node.uid)
        self._insert(d, name, node)
        node.nlink += 1
        self._charge(node, 1)
        node.touch(mtime=False)
        return node

    # ------------------------------------------------------------ removing

    def _detach(self, d: Node, name: bytes) -> Node:
        node = self._remove_entry(d, name)
        d.touch()
        if node.is_dir:
            node.nlink = 0
            d.nlink -= 1
        else:
            node.nlink -= 1
        self._charge(node, -1)
        node.touch(mtime=False)
        return node

    def unlink(self, parent: int, name: bytes) -> Node:
        node = self.lookup(parent, name)
        if name in (b".", b".."):
            raise _err(errno.EINVAL)
        if node.is_dir:
            raise _err(errno.EISDIR)
        return self._detach(self.dir(parent), name)

    def rmdir(self, parent: int, name: bytes) -> Node:
        if name == b".":
            raise _err(errno.EINVAL)
        if name == b"..":
            raise _err(errno.ENOTEMPTY)
        node = self.lookup(parent, name)
        if not node.is_dir:
            raise _err(errno.ENOTDIR)
        if node.entries:
            raise _err(errno.ENOTEMPTY)
        return self._detach(self.dir(parent), name)

    def rename(self, old_parent: int, old_name: bytes, new_parent: int, new_name: bytes,
               noreplace: bool = False, exchange: bool = False) -> Node | None:
        """Move a name; returns the node a replaced `new_name` pointed to (now with one
        name fewer), else None."""
        src_dir, dst_dir = self.dir(old_parent), self.dir(new_parent)
        if old_name in (b".", b"..") or new_name in (b".", b".."):
            raise _err(errno.EBUSY)
        node = self.lookup(old_parent, old_name)
        _check_length(new_name)
        if node.is_dir and self._is_within(dst_dir.ino, node.ino):
            raise _err(errno.EINVAL, "a directory cannot move into itself")
        other_ino = dst_dir.entries.get(new_name)
        other = self.nodes[other_ino] if other_ino is not None else None
        if exchange:
            if other is None:
                raise _err(errno.ENOENT, show(new_name))
            if other is node:
                return None          # two names of one file: nothing to exchange
            if other.is_dir and self._is_within(src_dir.ino, other.ino):
                raise _err(errno.EINVAL, "a directory cannot move into itself")
            src_dir.entries[old_name], dst_dir.entries[new_name] = other.ino, node.ino
            del node.links[src_dir.ino, old_name], other.links[dst_dir.ino, new_name]
            node.links[dst_dir.ino, new_name] = other.links[src_dir.ino, old_name] = None
            self.dirty_entries |= {(src_dir.ino, old_name), (dst_dir.ino, new_name)}
            for n, d in ((node, dst_dir), (other, src_dir)):
                if n.is_dir and n.parent != d.ino:
                    self.nodes[n.parent].nlink -= 1
                    d.nlink += 1
                    n.parent = d.ino
                n.touch(mtime=False)
            src_dir.touch()
            dst_dir.touch()
            return None
        if other is not None:
            if other.ino == node.ino:
                return None          # two links to one file: POSIX says do nothing
            if noreplace:
                raise _err(errno.EEXIST, show(new_name))
            if node.is_dir and not other.is_dir:
                raise _err(errno.ENOTDIR)
            if not node.is_dir and other.is_dir:
                raise _err(errno.EISDIR)
            if other.is_dir and other.entries:
                raise _err(errno.ENOTEMPTY)
            self._detach(dst_dir, new_name)
        self._remove_entry(src_dir, old_name)
        self._insert(dst_dir, new_name, node)
        if node.is_dir and src_dir is not dst_dir:
            src_dir.nlink -= 1
            dst_dir.nlink += 1
            node.parent = dst_dir.ino
        src_dir.touch()
        dst_dir.touch()
        node.touch(mtime=False)
        return other

    def _is_within(self, ino: int, ancestor: int) -> bool:
        """Whether directory `ino` is `ancestor` or below it."""
        while True:
            if ino == ancestor:
                return True
            if ino == ROOT:
                return False
            ino = self.nodes[ino].parent

    def drop_names(self, ino: int) -> list[tuple[int, bytes]]:
        """Remove every name of a file (its cache is gone); the removed names."""
        names = self.names_of(ino)
        for parent, name in names:
            self._detach(self.nodes[parent], name)
        return names

    # ------------------------------------------------------------ kernel references

    def forget(self, ino: int, n: int) -> Node | None:
        node = self.nodes.get(ino)
        if node is not None:
            node.lookups = max(0, node.lookups - n)
        return node

    @staticmethod
    def cache_unreferenced(node: Node) -> bool:
        """The cache may be freed: no name and no open left."""
        return node.is_file and node.nlink == 0 and node.opens == 0

    def collect(self, node: Node) -> bool:
        """Drop a node nobody can reach any more; whether it was dropped."""
        if node.ino != ROOT and node.nlink == 0 and node.opens == 0 and node.lookups == 0 \
                and node.cap is None:
            self.nodes.pop(node.ino, None)
            self.dirty.add(node.ino)
            return True
        return False

    # ------------------------------------------------------------ attributes

    def chmod(self, node: Node, mode: int) -> None:
        node.mode = stat.S_IFMT(node.mode) | (mode & 0o7777)
        node.touch(mtime=False)

    def chown(self, node: Node, uid: int | None, gid: int | None) -> None:
        """(The kernel lets only root give a file away; root may exceed a uid's bound.)"""
        if uid is not None and uid != node.uid:
            names = self._names(node)
            self._charge(node, -names)
            node.uid = uid
            self._charge(node, names)
        if gid is not None:
            node.gid = gid
        node.touch(mtime=False)

    @staticmethod
    def _names(node: Node) -> int:
        """How many names `node` has (a directory has at most one)."""
        if node.is_dir:
            return 1 if node.nlink > 0 and node.ino != ROOT else 0
        return node.nlink

    # ------------------------------------------------------------ xattrs

    def getxattr(self, node: Node, name: bytes) -> bytes:
        value = node.xattrs.get(name)
        if value is None:
            raise _err(errno.ENODATA, show(name))
        return value

    def setxattr(self, node: Node, name: bytes, value: bytes) -> None:
        xattrs.check(name, value)
        if name in xattrs.ACTIONS:
            raise _err(errno.EOPNOTSUPP, f"{show(name)} is an action, never stored")
        xattrs.check_room(node.xattrs, name, node.is_file)
        node.xattrs[name] = bytes(value)
        self.dirty.add(node.ino)              # changed in place: journal it explicitly
        node.touch(mtime=False)

    def removexattr(self, node: Node, name: bytes) -> None:
        if name in xattrs.READ_ONLY:
            raise _err(errno.EPERM, f"{show(name)} is read-only")
        if name not in node.xattrs:
            raise _err(errno.ENODATA, show(name))
        del node.xattrs[name]
        self.dirty.add(node.ino)
        node.touch(mtime=False)

    # ------------------------------------------------------------ persistence

    def linked(self, node: Node) -> bool:
        """Reachable from the root (a removed directory is empty, so nlink tells)."""
        return node.ino == ROOT or node.nlink > 0

    def take_changes(self) -> Changes:
        """The journal since the last call (then cleared), as rows to write."""
        inos, names = set(self.dirty), set(self.dirty_entries)
        self.dirty.clear()              # in place: every node holds this set
        self.dirty_entries.clear()
        rows, gone = [], []
        for ino in sorted(inos):
            node = self.nodes.get(ino)
            if node is not None and self.linked(node):
                rows.append(node_row(node))
            else:
                gone.append(ino)
        entries = []
        for d_ino, name in sorted(names):
            d = self.nodes.get(d_ino)
            ino = pos = None
            if d is not None and d.is_dir and self.linked(d) and name in d.entries:
                ino, pos = d.entries[name], d.order.position(name)
            entries.append((d_ino, name, ino, pos))
        return Changes(rows, gone, entries, inos)

    def untake(self, changes: Changes) -> None:
        """A write of `changes` failed: journal them again, to be written next time."""
        self.dirty |= changes.inos
        self.dirty_entries |= {(d, name) for d, name, _, _ in changes.entries}

    def to_dict(self) -> dict:
        """The linked part of the namespace as JSON-able data (capabilities included:
        the caller writes it where only root can read)."""
        reachable = self._reachable()
        return {"format": FORMAT, "next_ino": self.next_ino,
                "nodes": [node_to_dict(self.nodes[i]) for i in sorted(reachable)]}

    def _reachable(self) -> set[int]:
        seen, todo = {ROOT}, [ROOT]
        while todo:
            for ino in self.nodes[todo.pop()].entries.values():
                if ino not in seen:
                    seen.add(ino)
                    if self.nodes[ino].is_dir:
                        todo.append(ino)
        return seen

    @classmethod
    def from_dict(cls, doc: dict, names_per_uid: int = NAMES_PER_UID) -> Namespace:
        """The namespace `to_dict` (or the state directory) wrote. Only what the root
        reaches is kept; nlink, readdir order and parents are derived, not trusted."""
        if doc.get("format") != FORMAT:
            raise ValueError(f"unknown namespace format {doc.get('format')!r}")
        ns = cls(names_per_uid=names_per_uid)
        ns.nodes = {}
        for raw in doc["nodes"]:
            node = node_from_dict(raw)
            ns.nodes[node.ino] = node
        if ROOT not in ns.nodes or not ns.nodes[ROOT].is_dir:
            raise ValueError("namespace has no root")
        ns.next_ino = max(int(doc["next_ino"]), max(ns.nodes) + 1)
        # Walk from the root. An entry naming nothing, the root, or a directory already
        # named elsewhere (a state cut short by a crash) is dropped.
        dropped: set[tuple[int, bytes]] = set()
        reached, todo = {ROOT}, [ROOT]
        while todo:
            d = ns.nodes[todo.pop()]
            for name, ino in list(d.entries.items()):
                child = ns.nodes.get(ino)
                if child is None or (child.is_dir and ino in reached):
                    del d.entries[name]
                    dropped.add((d.ino, name))
                    continue
                if child.is_dir:
                    child.parent = d.ino
                    todo.append(ino)
                reached.add(ino)
        for ino in set(ns.nodes) - reached:       # unreachable: its cache is to be freed
            node = ns.nodes.pop(ino)
            if node.cap is not None:
                ns.lost_caps.append((node.replica, node.cap))
        for node in ns.nodes.values():
            node.nlink = 2 if node.is_dir else 0
        for d in ns.nodes.values():
            if d.is_dir:
                d.order = Listing(d.entries)
                for name, ino in d.entries.items():
                    child = ns.nodes[ino]
                    child.links[d.ino, name] = None
                    if child.is_dir:
                        d.nlink += 1
                    else:
                        child.nlink += 1
        for node in ns.nodes.values():
            node.journal = ns.dirty
            ns._charge(node, ns._names(node))
        ns.dirty.clear()                          # what was read is what is stored ...
        ns.dirty |= {int(raw["ino"]) for raw in doc["nodes"]} - set(ns.nodes)
        ns.dirty_entries |= dropped               # ... but for what was dropped
        return ns
