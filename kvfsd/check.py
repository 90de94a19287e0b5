"""kvfsd's own consistency check (predd's is `lip fsck`): the namespace agrees with
itself, and a state directory loads with nothing to repair.

    python -m kvfsd.check STATE      # kvfsd must not be running on STATE (exit 2 if it is)

`problems(ns)` checks a live namespace: every directory entry names a node, which lists
that (directory, name) among its `links`, and every link is such an entry; a file's
nlink is its number of names, a directory's 2 + its subdirectories, and a directory
other than the root has one name, in its `parent`; each directory's readdir listing
holds exactly its names; every node with a name is reachable from the root; the names
charged to each uid are the names its nodes have.

`check_state(path)` also runs SQLite's integrity check, checks that every snapshot a
file names exists and that every file's home replica is an address (or empty: a state
from before replicas), and reports what loading had to repair (entries naming nothing,
nodes no name reaches): each commit is one transaction, so after a crash at any point
the state loads with nothing to repair.
"""
from __future__ import annotations

import os
import sys
from collections import Counter

from kvfsd.namespace import Namespace
from kvfsd.node import ROOT, show
from kvfsd.state import StateDir, StateDirBusy
from symphony_protocol import descriptor
def problems(ns: Namespace) -> list[str]:
    out: list[str] = []
    names: dict[int, set[tuple[int, bytes]]] = {}
    for d in ns.nodes.values():
        if not d.is_dir:
            continue
        listed = [name for _, name in d.order.after(0)]
        if sorted(listed) != sorted(d.entries) or len(d.order) != len(d.entries):
            out.append(f"directory {d.ino}: its readdir listing is not its names")
        for name, ino in d.entries.items():
            if ino not in ns.nodes:
                out.append(f"directory {d.ino}: {show(name)!r} names no node ({ino})")
                continue
            names.setdefault(ino, set()).add((d.ino, name))
    uids: Counter[int] = Counter()
    for node in ns.nodes.values():
        mine = names.get(node.ino, set())
        if set(node.links) != mine:
            out.append(f"node {node.ino}: links {sorted(node.links)} but named by "
                       f"{sorted(mine)}")
        if node.is_dir:
            subdirs = sum(ns.nodes[i].is_dir for i in node.entries.values() if i in ns.nodes)
            linked = node.ino == ROOT or node.nlink > 0
            if linked and node.nlink != 2 + subdirs:
                out.append(f"directory {node.ino}: nlink {node.nlink}, "
                           f"{subdirs} subdirectories")
            if node.ino != ROOT and linked and [d for d, _ in mine] != [node.parent]:
                out.append(f"directory {node.ino}: parent {node.parent}, named in "
                           f"{sorted(d for d, _ in mine)}")
        elif node.nlink != len(mine):
            out.append(f"node {node.ino}: nlink {node.nlink}, {len(mine)} names")
        if node.ino != ROOT:
            uids[node.uid] += len(mine)
    if +uids != +ns.names_of_uid:
        out.append(f"names per uid {dict(+ns.names_of_uid)}, counted {dict(+uids)}")
    reached, todo = {ROOT}, [ROOT]
    while todo:
        for ino in ns.nodes[todo.pop()].entries.values():
            if ino in ns.nodes and ino not in reached:
                reached.add(ino)
                if ns.nodes[ino].is_dir:
                    todo.append(ino)
    unreached = sorted(i for i in names if i not in reached)
    if unreached:
        out.append(f"named but not reachable from the root: {unreached}")
    return out


def check_state(path: str) -> list[str]:
    """Problems of the state directory at `path` (StateDirBusy while a kvfsd uses it)."""
    state = StateDir(path)
    try:
        out = [f"sqlite: {row[0]}" for row in state.db.execute("PRAGMA integrity_check")
               if row[0] != "ok"]
        doc = state.load()
        if doc is None:
            return out
        ns = Namespace.from_dict(doc, names_per_uid=0)
        repaired = ns.take_changes()
        dropped = [f"{d}/{show(name)}" for d, name, _, _ in repaired.entries]
        if dropped:
            out.append(f"entries naming nothing: {dropped}")
        if repaired.gone:
            out.append(f"stored nodes no name reaches: {sorted(repaired.gone)}")
        snapshots = state.snapshot_names()
        out += [f"node {n.ino}: snapshot {n.snapshot} missing" for n in ns.nodes.values()
                if n.snapshot and n.snapshot not in snapshots]
        out += [f"node {n.ino}: replica {n.replica[:80]!r} is not an address"
                for n in ns.nodes.values()
                if n.replica and not descriptor.valid_replica(n.replica)]
        return out + problems(ns)
    finally:
        state.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kvfsd.check STATE", file=sys.stderr)
        return 2
    if not os.path.isdir(args[0]):
        print(f"{args[0]}: no such state directory", file=sys.stderr)
        return 2
    try:
        found = check_state(args[0])
    except StateDirBusy as exc:
        print(exc, file=sys.stderr)
        return 2
    for line in found:
        print(line)
    print("clean" if not found else f"{len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
