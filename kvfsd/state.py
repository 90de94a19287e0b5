"""kvfsd's state directory: the namespace and the fsync'd cache snapshots.

    STATE/namespace.json     every linked inode: names, modes, owners, times, xattrs and
                             the persistent capability of each cache (secrets: 0600)
    STATE/snapshots/N.kvx    the kv_export bytes of inode N at its last fsync
    STATE/lock               held (flock) by the kvfsd using this directory

Every write is atomic and durable (temporary file, fsync, rename, fsync of the
directory), so a crash — of kvfsd or of the machine — leaves the previous version or
the new one, never half of either. The directory is 0700 and every file 0600:
capabilities must not leak to other users.
"""
from __future__ import annotations

import fcntl
import json
import os

NAMESPACE = "namespace.json"
SNAPSHOTS = "snapshots"


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

    def close(self) -> None:
        os.close(self._lock)

    # ------------------------------------------------------------ namespace

    def load(self) -> dict | None:
        try:
            with open(os.path.join(self.path, NAMESPACE), "rb") as f:
                return json.loads(f.read())
        except FileNotFoundError:
            return None

    def save(self, doc: dict) -> None:
        data = json.dumps(doc, separators=(",", ":")).encode()
        self._write(os.path.join(self.path, NAMESPACE), data)

    # ------------------------------------------------------------ snapshots

    def snapshot_path(self, name: str) -> str:
        return os.path.join(self.path, SNAPSHOTS, os.path.basename(name))

    def write_snapshot(self, ino: int, blob: bytes) -> str:
        """Store a cache export durably; the name to record in the namespace."""
        name = f"{ino}.kvx"
        self._write(self.snapshot_path(name), blob)
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

    # ------------------------------------------------------------ atomic write

    @staticmethod
    def _write(path: str, data: bytes) -> None:
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
