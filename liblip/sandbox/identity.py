"""Who a sandboxed run is: a uid (and a gid of the same number), never 0.

By default every run gets a fresh uid from [UID_BASE, UID_BASE + UID_COUNT): the next
one after the last handed out (a counter, so ids come back only after UID_COUNT runs)
that no passwd/group entry names, no live process owns, and no other run holds. A run
holds its uid by a byte-range lock on one file in STATE_DIR (root-only), for as long
as its launcher lives. `--uid UID` (the gateway's mapped users) skips the allocation.
"""
from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
import stat
from dataclasses import dataclass

UID_BASE = 200000
UID_COUNT = 65536
STATE_DIR = "/run/symphony/sandbox"


class IdentityError(OSError):
    pass


@dataclass
class Identity:
    uid: int
    gid: int
    lock_fd: int | None = None   # held while the run lives

    def release(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)   # drops the byte-range lock
            self.lock_fd = None


def fixed(uid: int) -> Identity:
    """The identity for `--uid UID`."""
    if uid == 0:
        raise IdentityError(errno.EPERM, "--uid 0: a sandboxed program never runs as root")
    if not 0 < uid < 0xFFFFFFFF:
        raise IdentityError(errno.EINVAL, f"--uid {uid}: not a uid")
    return Identity(uid, uid)


def private_dir(path: str) -> str:
    """Make (or check) a root-owned directory nobody else can write or enter."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
        raise IdentityError(errno.EPERM, f"{path} must be a directory owned by root, mode 0700")
    return path


def uids_in_use() -> set[int]:
    """Real, effective, saved and fs uids of every live process (zombies included)."""
    used: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("Uid:"):
                        used.update(int(x) for x in line.split()[1:])
                        break
        except OSError:   # the process is gone
            continue
    return used


def _named(uid: int) -> bool:
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def fresh(state_dir: str = STATE_DIR) -> Identity:
    """A uid no one else uses, held until `release()` (or the launcher's exit)."""
    private_dir(state_dir)
    fd = os.open(os.path.join(state_dir, "uids.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # one allocation at a time; held locks stay
        counter_path = os.path.join(state_dir, "next-uid")
        try:
            with open(counter_path) as f:
                start = int(f.read().strip() or 0) % UID_COUNT
        except (FileNotFoundError, ValueError):
            start = 0
        in_use = uids_in_use()
        for i in range(UID_COUNT):
            slot = (start + i) % UID_COUNT
            uid = UID_BASE + slot
            if uid in in_use or _named(uid):
                continue
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, slot)
            except OSError:   # another run holds it
                continue
            with open(counter_path + ".new", "w") as f:
                f.write(f"{slot + 1}\n")
            os.replace(counter_path + ".new", counter_path)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return Identity(uid, uid, fd)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    raise IdentityError(errno.EAGAIN, f"no free uid in [{UID_BASE}, {UID_BASE + UID_COUNT})")
