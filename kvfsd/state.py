"""kvfsd's state directory: the namespace and the fsync'd cache snapshots.

    STATE/namespace.db       SQLite (WAL): a row per linked inode (modes, owners, times,
                             xattrs, the persistent capability of each cache and its home
                             replica), a row per directory entry, and a few meta values
                             (`pending_free`: [replica, capability] pairs) (secrets: 0600)
    STATE/snapshots/N.kvx    the kv_export bytes of inode N at its last fsync
    STATE/lock               held (flock) by the kvfsd using this directory

The namespace is written incrementally: one transaction per commit holds exactly the
rows that changed (`apply`), so a change costs O(change), not O(namespace). Every
commit is durable (synchronous=FULL) and atomic: a crash — of kvfsd or of the machine —
leaves the state before the commit or after it, never half of it. Snapshots are
written atomically too (temporary file, fsync, rename, fsync of the directory). The
directory is 0700 and every file 0600: capabilities must not leak to other users.
A `namespace.json` of an earlier kvfsd is read once, stored in the database, and removed.
"""
from __future__ import annotations

import base64
import fcntl
import json
import os
import sqlite3

DATABASE = "namespace.db"
LEGACY = "namespace.json"
SNAPSHOTS = "snapshots"

SCHEMA = """
CREATE TABLE IF NOT EXISTS node (ino INTEGER PRIMARY KEY, doc TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entry (dir INTEGER NOT NULL, name BLOB NOT NULL,
                                  ino INTEGER NOT NULL, pos INTEGER NOT NULL,
                                  PRIMARY KEY (dir, name));
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def default_state_dir() -> str:
    """/var/lib/symphony/kvfs for root, else $XDG_STATE_HOME/symphony/kvfs."""
    if os.geteuid() == 0:
        return "/var/lib/symphony/kvfs"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "symphony", "kvfs")


class StateDirBusy(Exception):
    pass


class StateDir:
    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(os.path.join(self.path, SNAPSHOTS), mode=0o700, exist_ok=True)
        os.chmod(self.path, 0o700)
        os.chmod(os.path.join(self.path, SNAPSHOTS), 0o700)
        self._lock = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise StateDirBusy(f"{self.path} is in use by another kvfsd") from None
        db = os.path.join(self.path, DATABASE)
        os.close(os.open(db, os.O_RDWR | os.O_CREAT, 0o600))   # SQLite's files inherit 0600
        # One connection, used by one thread at a time (kvfsd serialises its commits).
        self.db = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()
        os.close(self._lock)

    # ------------------------------------------------------------ namespace

    def load(self) -> dict | None:
        """The namespace document (`Namespace.from_dict`'s shape, with `pending_free`),
        or None for a new state directory."""
        meta = dict(self.db.execute("SELECT key, value FROM meta"))
        if "format" not in meta:
            return self._migrate()
        nodes = {ino: json.loads(doc) for ino, doc in self.db.execute("SELECT ino, doc FROM node")}
        for raw in nodes.values():
            if "entries" not in raw and _is_dir(raw):
                raw["entries"] = []
        for d, name, ino in self.db.execute("SELECT dir, name, ino FROM entry ORDER BY dir, pos"):
            if d in nodes:
                nodes[d].setdefault("entries", []).append([_b64(name), ino])
        return {"format": int(meta["format"]), "next_ino": int(meta["next_ino"]),
                "nodes": list(nodes.values()),
                "pending_free": json.loads(meta.get("pending_free", "[]"))}

    def _migrate(self) -> dict | None:
        legacy = os.path.join(self.path, LEGACY)
        try:
            with open(legacy, "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return None
        self.save(doc)
        os.unlink(legacy)
        return doc

    def save(self, doc: dict) -> None:
        """Replace the whole namespace with `doc` (what `Namespace.to_dict` returns, with
        `pending_free`)."""
        rows, entries = [], []
        for raw in doc["nodes"]:
            raw = dict(raw)
            for pos, (name, ino) in enumerate(raw.pop("entries", []), start=3):
                entries.append((int(raw["ino"]), base64.b64decode(name), int(ino), pos))
            rows.append(raw)
        with self._transaction() as db:
            db.execute("DELETE FROM node")
            db.execute("DELETE FROM entry")
            db.execute("DELETE FROM meta")
            self._write(db, rows, [], entries, _meta(doc))

    def apply(self, rows: list[dict], gone: list[int],
              entries: list[tuple[int, bytes, int | None, int | None]], meta: dict) -> None:
        """One commit: upsert `rows`, delete the inodes in `gone` (and their entries),
        set or remove each (directory, name) entry, and set `meta`."""
        with self._transaction() as db:
            self._write(db, rows, gone, entries, meta)

    def _transaction(self):
        return _Transaction(self.db)

    @staticmethod
    def _write(db, rows, gone, entries, meta) -> None:
        db.executemany("INSERT OR REPLACE INTO node (ino, doc) VALUES (?, ?)",
                       [(int(r["ino"]), json.dumps(r, separators=(",", ":"))) for r in rows])
        db.executemany("DELETE FROM node WHERE ino = ?", [(ino,) for ino in gone])
        db.executemany("DELETE FROM entry WHERE dir = ?", [(ino,) for ino in gone])
        db.executemany("DELETE FROM entry WHERE dir = ? AND name = ?",
                       [(d, name) for d, name, ino, _ in entries if ino is None])
        db.executemany("INSERT OR REPLACE INTO entry (dir, name, ino, pos) VALUES (?, ?, ?, ?)",
                       [(d, name, ino, pos) for d, name, ino, pos in entries if ino is not None])
        db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                       [(k, json.dumps(v)) for k, v in meta.items()])

    # ------------------------------------------------------------ snapshots

    def snapshot_path(self, name: str) -> str:
        return os.path.join(self.path, SNAPSHOTS, os.path.basename(name))

    def write_snapshot(self, ino: int, blob: bytes) -> str:
        """Store a cache export durably; the name to record in the namespace."""
        name = f"{ino}.kvx"
        _write_file(self.snapshot_path(name), blob)
        return name

    def read_snapshot(self, name: str) -> bytes:
        with open(self.snapshot_path(name), "rb") as f:
            return f.read()

    def remove_snapshot(self, name: str) -> None:
        try:
            os.unlink(self.snapshot_path(name))
        except FileNotFoundError:
            pass

    def snapshot_names(self) -> set[str]:
        """Every file in the snapshot directory (temporaries of a crashed write too)."""
        return set(os.listdir(os.path.join(self.path, SNAPSHOTS)))


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind, exc, tb) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def _meta(doc: dict) -> dict:
    return {"format": doc["format"], "next_ino": doc["next_ino"],
            "pending_free": list(doc.get("pending_free", []))}


def _is_dir(raw: dict) -> bool:
    return (int(raw["mode"]) & 0o170000) == 0o040000


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _write_file(path: str, data: bytes) -> None:
    """Atomically and durably: temporary file, fsync, rename, fsync of the directory."""
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)           # a full disk must not leave a half file behind
        raise
    os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
