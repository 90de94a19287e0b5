"""One inode of the namespace, and the form it is stored in.

A node journals its own changes: assigning a persisted field a different value adds
its inode to `journal` (the namespace's dirty set), so the state directory is written
in O(changes). Runtime and derived fields (`UNJOURNALED`) are not journaled. Changes
made in place (`xattrs`, a directory's `entries`) are journaled by the namespace.
`links` (every (directory, name) naming the node) is a runtime index the namespace
keeps, so a node's names are found in O(its names), never by a scan.
"""
from __future__ import annotations

import base64
import stat
import time
from dataclasses import dataclass, field

from kvfsd import xattrs
from kvfsd.listing import Listing

ROOT = 1

_UNSET = object()
# Fields that are runtime state or derived on load: changing them is not a change to save.
UNJOURNALED = frozenset({"lookups", "opens", "journal", "order", "parent", "links",
                         "closed_at", "tier"})


def now_ns() -> int:
    return time.time_ns()


@dataclass
class Node:
    ino: int
    mode: int                  # st_mode, type bits included
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    nlink: int = 0
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    # directories
    entries: dict[bytes, int] | None = None     # name -> inode
    order: Listing | None = None                # readdir positions of the names
    parent: int = ROOT
    # symbolic links
    target: bytes = b""
    # cache files: predd's view, as last seen
    cap: str | None = None     # persistent capability; a secret, never logged
    tokens: int = 0
    pages: int = 0
    bytes: int = 0
    snapshot: str | None = None   # file name of the last fsync'd snapshot in the state dir
    replica: str = ""          # the home replica's address ("": replica 0, a state from before)
    # runtime only
    lookups: int = 0
    opens: int = 0
    closed_at: float = 0.0     # time.monotonic() of the release of its last open
    tier: str = ""             # predd's tier of the cache, as last seen
    links: dict[tuple[int, bytes], None] = field(default_factory=dict)  # (dir, name)s
    journal: set[int] | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value) -> None:
        journal = self.__dict__.get("journal")
        if journal is not None and name not in UNJOURNALED \
                and self.__dict__.get(name, _UNSET) != value:
            journal.add(self.__dict__["ino"])       # a change, not a mere re-assignment
        object.__setattr__(self, name, value)

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)

    def touch(self, *, mtime: bool = True) -> None:
        t = now_ns()
        self.ctime_ns = t
        if mtime:
            self.mtime_ns = t


def show(name: bytes) -> str:
    return name.decode("utf-8", "backslashreplace")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def node_to_dict(n: Node) -> dict:
    out = node_row(n)
    if n.is_dir:
        out["entries"] = [[b64(name), n.entries[name]] for _, name in n.order.after(0)]
    return out


def node_row(n: Node) -> dict:
    """A node without its directory entries (those are rows of their own)."""
    out = {"ino": n.ino, "mode": n.mode, "uid": n.uid, "gid": n.gid,
           "atime_ns": n.atime_ns, "mtime_ns": n.mtime_ns, "ctime_ns": n.ctime_ns}
    if n.xattrs:
        out["xattrs"] = {b64(k): b64(v) for k, v in n.xattrs.items()}
    if n.is_symlink:
        out["target"] = b64(n.target)
    else:
        out.update(cap=n.cap, tokens=n.tokens, pages=n.pages, bytes=n.bytes,
                   snapshot=n.snapshot)
        if n.replica:
            out["replica"] = n.replica
    return out


def node_from_dict(raw: dict) -> Node:
    node = Node(int(raw["ino"]), int(raw["mode"]), int(raw["uid"]), int(raw["gid"]),
                int(raw["atime_ns"]), int(raw["mtime_ns"]), int(raw["ctime_ns"]))
    node.xattrs = xattrs.loaded({base64.b64decode(k): base64.b64decode(v)
                                 for k, v in raw.get("xattrs", {}).items()}, node.is_file)
    if node.is_dir:
        node.entries = {base64.b64decode(name): int(ino) for name, ino in raw.get("entries", [])}
        node.order = Listing()
    elif node.is_symlink:
        node.target = base64.b64decode(raw.get("target", ""))
    else:
        node.cap = raw.get("cap")
        node.tokens = int(raw.get("tokens", 0))
        node.pages = int(raw.get("pages", 0))
        node.bytes = int(raw.get("bytes", 0))
        node.snapshot = raw.get("snapshot")
        node.replica = str(raw.get("replica", ""))
    return node
