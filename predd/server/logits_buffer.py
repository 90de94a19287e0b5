"""A session's logits buffer: a `pred`'s raw logits row written into the client's memory
instead of sent through the socket.

An ipc client may name a sealed memfd of its own in `hello` (`logits_fd`: the
descriptor's number in the client process; `logits_slots`: how many rows; its size
exactly `slots` rows of the vocabulary, each rounded up to a page). predd takes a
duplicate of that descriptor with pidfd_getfd (the pid is the kernel's, SO_PEERCRED),
checks it, maps it, and from then on copies the one row of a `pred` that names
`into: slot` into that slot, replying `logits: {shape, dtype, slot}` with no frame. A
round trip then moves ~150 bytes through ZeroMQ instead of 196 KB (docs/protocol.md,
"Logits buffer", has the numbers).

Why it cannot hurt predd or another session:
* Only a memfd sealed against shrinking and growing (`F_SEAL_SHRINK | F_SEAL_GROW |
  F_SEAL_SEAL`, not write-sealed), of exactly the expected size, owned by the session's
  uid. No one can truncate it under predd's mapping (no SIGBUS), predd never resizes or
  empties it, and a memfd is anonymous: whatever process the descriptor came from, it
  is no one's named file, and it belongs to the session's own uid, so predd writes only
  into memory of the uid that asked (even if the pid were reused by another process).
* The client allocates every page first (`st_blocks`, checked at attach and before each
  write; a punched hole drops the buffer): predd's writes allocate nothing, so the
  pages stay charged to the client's memory, not predd's, and a write cannot fail for
  want of memory. predd writes through its own mapping (a memory copy): no file lock a
  client could hold to stall predd's loop. (A client could still page its memory out and
  make a copy wait for it to come back.)
* `into` must name one of the session's slots (EINVAL), checked against the buffer the
  call was submitted with; one row goes there.
* At most `MAX_SLOTS` rows a session, `max_live()` buffers (a quarter of predd's
  open-file limit: each costs a descriptor) and `max_bytes()` of rows in all (the pages
  predd's writes may fill; an eighth of the machine's memory): EMFILE, ENOMEM past them.
  One uid may hold at most half of each (`UID_SHARE`), so no user's sessions can take
  every buffer from the others; predd's own uid is exempt, as from its other uid
  limits (predd/server/quotas.py). The descriptor and mapping go with the session.
A refusal is not an error: hello's reply says why (`logits_buffer`), and the client
keeps getting frames.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import resource
import stat

import numpy as np

from symphony_protocol.logits_buffer import SEALS, slot_bytes
from symphony_protocol import ProtocolError

MAX_SLOTS = 64
UID_SHARE = 2                 # one uid holds at most 1/UID_SHARE of the buffers and bytes
TMPFS_MAGIC = 0x01021994
SYS_PIDFD_GETFD = 438         # the same number on every architecture (unified table)
_STATFS_BYTES = 120           # struct statfs; f_type is its first long
WRITE_SEALS = fcntl.F_SEAL_WRITE | getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def max_live() -> int:
    """How many buffers predd holds at most: two descriptors each (the file and its
    mapping's), a quarter of its open-file limit in all."""
    return max(1, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8)


def max_bytes() -> int:
    """How many bytes of rows all buffers may hold: an eighth of physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8


def raise_open_file_limit() -> int:
    """The soft open-file limit raised to the hard one (a connection and a buffer each
    take a descriptor; a soft 1024 is common under a hard 500,000+); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            return soft
    return hard


class LogitsBuffer:
    """The client's memfd, as predd maps it: `slots` rows of `slot_bytes` each."""
    live = 0                 # buffers held now, in this process
    held_bytes = 0           # their slots' bytes
    of_uid: dict[int, tuple[int, int]] = {}   # uid: (buffers, bytes) it holds now

    def __init__(self, fd: int, view: mmap.mmap, slots: int, row_bytes: int,
                 uid: int) -> None:
        self.fd, self.slots, self.slot_bytes, self.uid = fd, slots, row_bytes, uid
        self._view = view          # (with a descriptor of its own)
        self._rows = np.frombuffer(view, dtype=np.float32).reshape(slots, row_bytes // 4)
        self._count(+1)

    def _count(self, sign: int) -> None:
        size = sign * self.slots * self.slot_bytes
        LogitsBuffer.live += sign
        LogitsBuffer.held_bytes += size
        live, held = LogitsBuffer.of_uid.get(self.uid, (0, 0))
        if (live + sign, held + size) == (0, 0):
            LogitsBuffer.of_uid.pop(self.uid, None)
        else:
            LogitsBuffer.of_uid[self.uid] = (live + sign, held + size)

    @classmethod
    def attach(cls, pid: int, fd: int, slots: int, vocab: int, uid: int,
               exempt: bool = False) -> LogitsBuffer:
        """Client `pid`'s descriptor `fd` (of a session of `uid`), checked and mapped
        for `slots` rows. ProtocolError (its errno and why) when it cannot serve.
        `exempt`: the uid's share is not checked (predd's own uid)."""
        if not 1 <= slots <= MAX_SLOTS:
            raise ProtocolError("EINVAL", f"logits_slots must be in [1, {MAX_SLOTS}]")
        if not 0 <= fd < 2**31:
            raise ProtocolError("EBADF", "logits_fd: not a descriptor number")
        if pid <= 0:
            raise ProtocolError("EOPNOTSUPP", "only ipc clients (whose pid the kernel "
                                "gives) can share a logits buffer")
        if cls.live >= max_live():
            raise ProtocolError("EMFILE", f"predd holds {cls.live} logits buffers, its "
                                "most (a quarter of its open-file limit)")
        size = slots * slot_bytes(vocab)
        if cls.held_bytes + size > max_bytes():
            raise ProtocolError("ENOMEM", "predd's logits buffers hold their most bytes "
                                "(an eighth of its memory)")
        live, held = cls.of_uid.get(uid, (0, 0))
        if not exempt and live >= max(1, max_live() // UID_SHARE):
            raise ProtocolError("EMFILE", f"uid {uid} holds {live} logits buffers, its "
                                f"most (1/{UID_SHARE} of predd's)")
        if not exempt and held + size > max_bytes() // UID_SHARE:
            raise ProtocolError("ENOMEM", f"uid {uid}'s logits buffers would hold more "
                                f"than its share of their bytes (1/{UID_SHARE})")
        mine = _take_fd(pid, fd)
        try:
            _check(mine, size, uid)
            view = mmap.mmap(mine, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            os.close(mine)
            code = _errno_name(exc) if isinstance(exc, OSError) else "EINVAL"
            raise ProtocolError(code, f"logits_fd: {exc}") from None
        except ProtocolError:
            os.close(mine)
            raise
        return cls(mine, view, slots, slot_bytes(vocab), uid)

    @property
    def closed(self) -> bool:
        return self._view.closed

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ProtocolError("EINVAL", f"into: this session's logits buffer has slots "
                                f"0..{self.slots - 1}")

    def write(self, slot: int, row: np.ndarray) -> bool:
        """Copy one float32 row into `slot`; False (the reply then carries it as a
        frame) when it does not fit or the buffer is closed."""
        if self.closed or not 0 <= slot < self.slots or row.size * 4 > self.slot_bytes:
            return False
        if not _allocated(self.fd, self.slots * self.slot_bytes):
            self.close()           # a hole punched: predd's copy would allocate for it
            return False
        self._rows[slot, :row.size] = row
        return True

    def close(self) -> None:
        if not self.closed:
            self._rows = None
            self._view.close()
            os.close(self.fd)
            self.fd = -1
            self._count(-1)


def _take_fd(pid: int, fd: int) -> int:
    """A duplicate of process `pid`'s descriptor `fd` (pidfd_getfd: Linux 5.6, and
    ptrace access to the process: predd as root, or the same uid where Yama allows)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError as exc:
        raise ProtocolError(_errno_name(exc), f"logits_fd: pidfd_open: {exc.strerror}") from None
    try:
        mine = _libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if mine < 0:
            err = ctypes.get_errno()
            raise ProtocolError(_errno_name(OSError(err, "")),
                                f"logits_fd: pidfd_getfd: {os.strerror(err)}")
        return mine
    finally:
        os.close(pidfd)


def _check(fd: int, size: int, uid: int) -> None:
    """ProtocolError unless `fd` is a memfd on tmpfs of `uid`, sealed against resizing
    (not against writes), of exactly `size` bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ProtocolError("EINVAL", "logits_fd: not a regular file")
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0 or ctypes.c_long.from_buffer(buf).value != TMPFS_MAGIC:
        raise ProtocolError("EINVAL", "logits_fd: not a memfd")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        raise ProtocolError("EINVAL", "logits_fd: not a memfd made with "
                            "MFD_ALLOW_SEALING") from None
    if seals & SEALS != SEALS or seals & WRITE_SEALS:
        raise ProtocolError("EINVAL", "logits_fd: must be sealed with F_SEAL_SHRINK, "
                            "F_SEAL_GROW and F_SEAL_SEAL, and not against writes")
    if st.st_uid != uid:
        raise ProtocolError("EPERM", f"logits_fd: a file of uid {st.st_uid}, not of this "
                            f"session's uid {uid}")
    st = os.fstat(fd)              # again: the size may have changed before the seals
    if st.st_size != size:
        raise ProtocolError("EINVAL", f"logits_fd: {st.st_size} bytes, not the "
                            f"{size} its slots need")
    if not _allocated(fd, size):
        raise ProtocolError("EINVAL", "logits_fd: not allocated in full (fallocate it "
                            "first: predd's writes must not allocate pages)")


def _allocated(fd: int, size: int) -> bool:
    """Whether every page of the file has memory (no hole for a write to fill)."""
    return os.fstat(fd).st_blocks * 512 >= size


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, "EIO")
