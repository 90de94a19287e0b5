"""A session's logits buffer: a `pred`'s raw logits row written into the client's memory
instead of sent through the socket.

An ipc client may name a file of its own in `hello` (`logits_fd`: the descriptor's
number in the client process; `logits_slots`: how many rows). predd takes a duplicate of
that descriptor with pidfd_getfd (the pid is the kernel's, SO_PEERCRED), checks it, sizes
it to `slots` rows of the vocabulary (each rounded up to a page), and from then on writes
the one row of a `pred` that names `into: slot` there with pwrite, replying
`logits: {shape, dtype, slot}` with no frame. A round trip then moves ~150 bytes through
ZeroMQ instead of 196 KB (docs/protocol.md, "Logits buffer", has the numbers).

Why it cannot hurt predd or another session:
* predd holds only a duplicate of a descriptor the client already had, with the access
  mode the client opened it with: it can write only where the client could write itself.
* The file must be a regular file on tmpfs (a memfd, /dev/shm, the sandbox's scratch):
  a write is a memory copy, never I/O that could stall the step (a FUSE or network
  file could; kvfsd's own files could deadlock it).
* pwrite, never a mapping: the client may truncate or seal its file at any time; a write
  then fails or extends the client's own file, where a mapping would fault predd
  (SIGBUS).
* `into` must name one of the session's slots (EINVAL); one row goes there, at most
  `MAX_SLOTS` rows per session; a write that fails falls back to the frame; the
  descriptor is closed with the session.
* A buffer costs predd a descriptor: at most a quarter of its open-file limit are held
  (`max_live`; EMFILE past it), so buffers never take the descriptors that new
  connections need.
A refusal is not an error: hello's reply says why (`logits_buffer`), and the client
keeps getting frames.
"""
from __future__ import annotations

import ctypes
import errno
import os
import resource
import stat

from liblip.protocol import ProtocolError

MAX_SLOTS = 64
PAGE = 4096
TMPFS_MAGIC = 0x01021994
SYS_PIDFD_GETFD = 438         # the same number on every architecture (unified table)
_STATFS_BYTES = 120           # struct statfs; f_type is its first long

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def slot_bytes(vocab: int) -> int:
    """One row of float32 logits, rounded up to whole pages."""
    return -(-vocab * 4 // PAGE) * PAGE


def max_live() -> int:
    """How many buffers predd holds at most: a quarter of its open-file limit."""
    return max(1, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 4)


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
    """The client's file, as predd holds it: `slots` rows of `slot_bytes` each."""
    live = 0                 # buffers held now, in this process

    def __init__(self, fd: int, slots: int, row_bytes: int) -> None:
        self.fd, self.slots, self.slot_bytes = fd, slots, row_bytes
        LogitsBuffer.live += 1

    @classmethod
    def attach(cls, pid: int, fd: int, slots: int, vocab: int) -> LogitsBuffer:
        """The client `pid`'s descriptor `fd`, checked and sized for `slots` rows.
        ProtocolError (its errno and why) when it cannot serve as a buffer."""
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
        mine = _take_fd(pid, fd)
        try:
            _check(mine)
            size = slots * slot_bytes(vocab)
            if os.fstat(mine).st_size != size:
                os.ftruncate(mine, size)
        except OSError as exc:
            os.close(mine)
            raise ProtocolError(_errno_name(exc), f"logits_fd: {exc.strerror}") from None
        except ProtocolError:
            os.close(mine)
            raise
        return cls(mine, slots, slot_bytes(vocab))

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ProtocolError("EINVAL", f"into: this session's logits buffer has slots "
                                f"0..{self.slots - 1}")

    def write(self, slot: int, row: memoryview) -> bool:
        """Put one row (its bytes) in `slot`; False when the client's file no longer
        takes it whole (truncated, sealed, its tmpfs full): the reply then carries the
        row as a frame."""
        if row.nbytes > self.slot_bytes:
            return False
        try:
            return os.pwrite(self.fd, row, slot * self.slot_bytes) == row.nbytes
        except OSError:
            return False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            LogitsBuffer.live -= 1


def _take_fd(pid: int, fd: int) -> int:
    """A duplicate of process `pid`'s descriptor `fd` (pidfd_getfd: Linux 5.6, and
    ptrace access to the process: predd as root, or the same uid)."""
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


def _check(fd: int) -> None:
    """EINVAL unless `fd` is a regular file on tmpfs (a memory copy to write, never I/O)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        raise ProtocolError("EINVAL", "logits_fd: not a regular file")
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    if ctypes.c_long.from_buffer(buf).value != TMPFS_MAGIC:
        raise ProtocolError("EINVAL", "logits_fd: not on tmpfs (a memfd, /dev/shm or "
                            "another tmpfs): a write there could wait on I/O")


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, "EIO")
