"""The logits buffer, both halves, in one process (its own pid stands for the client's):
predd maps only a memfd of the session's uid, sealed against resizing, of the exact size
(each refusal errno-named) and writes a row at its slot and nowhere else; the client
cannot shrink it under predd; liblip hands out the lowest free slot, gives it back after
a reply and retires it when no reply came."""
from __future__ import annotations

import ctypes
import fcntl
import os
import resource

import numpy as np
import pytest

from liblip.client import LipError
from liblip.logits_buffer import LogitsBuffer as ClientBuffer
from predd.server import logits_buffer as lb
from liblip.logits_buffer import slot_bytes
from predd.server.logits_buffer import MAX_SLOTS, LogitsBuffer
from tests.unit.helpers import code

VOCAB = 1000                       # 4000 bytes a row: one page a slot
UID = os.getuid()


def attach(fd: int, slots: int = 3, uid: int = UID, exempt: bool = False) -> LogitsBuffer:
    return LogitsBuffer.attach(os.getpid(), fd, slots, VOCAB, uid, exempt)


def refusal(fd: int, slots: int = 3, pid: int | None = None, uid: int = UID,
            exempt: bool = False) -> str:
    return code(lambda: LogitsBuffer.attach(os.getpid() if pid is None else pid, fd,
                                            slots, VOCAB, uid, exempt))


def sealed(size: int, seals: int = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
           | fcntl.F_SEAL_SEAL, allocate: bool = True) -> int:
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def test_slot_is_a_row_rounded_to_pages():
    assert slot_bytes(1000) == 4096
    assert slot_bytes(1024) == 4096
    assert slot_bytes(49152) == 196608
    assert slot_bytes(49153) == 200704


def test_attach_maps_and_writes_only_the_named_slot():
    client = ClientBuffer.create(VOCAB, slots=3)
    assert client is not None and (client.slots, client.slot_bytes) == (3, 4096)
    buf = attach(client.fd)
    try:
        assert (buf.slots, buf.slot_bytes) == (3, 4096)
        row = np.arange(VOCAB, dtype=np.float32)
        assert buf.write(1, row)
        data = np.frombuffer(os.pread(client.fd, 3 * 4096, 0), np.float32).reshape(3, 1024)
        assert np.array_equal(data[1, :VOCAB], row)
        assert not data[0].any() and not data[2].any() and not data[1, VOCAB:].any()
        assert np.array_equal(client.row(1, VOCAB), row)
        assert not buf.write(0, np.zeros(1025, np.float32))      # more than a slot
        assert not buf.write(3, row) and not buf.write(-1, row)  # not a slot
        assert code(lambda: buf.check_slot(-1)) == code(lambda: buf.check_slot(3)) == "EINVAL"
        with pytest.raises(PermissionError):                     # sealed: not under predd
            os.ftruncate(client.fd, 0)
    finally:
        buf.close()
        client.close()
    assert buf.closed and not buf.write(0, row)                  # closed: a frame


def test_refusals_are_errno_named():
    r, w = os.pipe()
    proc = os.open("/proc/self/status", os.O_RDONLY)          # regular, not a memfd
    size = 3 * 4096
    unsealed = os.memfd_create("t")
    os.ftruncate(unsealed, size)
    shrinkable = sealed(size, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    open_seals = sealed(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)   # could be write-sealed later
    write_sealed = sealed(size, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
                          | fcntl.F_SEAL_SEAL)
    wrong_size = sealed(size + 4096)
    sparse = sealed(size, allocate=False)                    # predd's writes would allocate
    good = sealed(size)
    fds = [r, w, proc, unsealed, shrinkable, open_seals, write_sealed, wrong_size, sparse, good]
    try:
        assert refusal(w) == "EINVAL"
        assert refusal(proc) == "EINVAL"
        for fd in (unsealed, shrinkable, open_seals, write_sealed, wrong_size, sparse):
            assert refusal(fd) == "EINVAL"
        assert refusal(good, uid=UID + 1) == "EPERM"           # not the session uid's
        assert refusal(good, slots=0) == "EINVAL"
        assert refusal(good, slots=MAX_SLOTS + 1) == "EINVAL"
        assert refusal(good, pid=0) == "EOPNOTSUPP"
        assert refusal(-5) == "EBADF"
        assert refusal(65535) == "EBADF"                       # not open in the client
        assert LogitsBuffer.live == 0 and LogitsBuffer.held_bytes == 0
    finally:
        for fd in fds:
            os.close(fd)


def test_buffers_are_bounded_by_descriptors_and_bytes(monkeypatch):
    """predd's own limits, for every uid (its own, exempt from the uid share, here)"""
    fds = [sealed(3 * 4096) for _ in range(2)]
    try:
        monkeypatch.setattr(lb, "max_live", lambda: 1)
        first = attach(fds[0], exempt=True)
        assert refusal(fds[1], exempt=True) == "EMFILE"
        first.close()
        monkeypatch.setattr(lb, "max_live", lambda: 10)
        monkeypatch.setattr(lb, "max_bytes", lambda: 5 * 4096)
        first = attach(fds[0], exempt=True)
        assert LogitsBuffer.held_bytes == 3 * 4096
        assert refusal(fds[1], exempt=True) == "ENOMEM"                     # 6 pages > 5
        first.close()
        first.close()                                          # twice: counted once
        assert (LogitsBuffer.live, LogitsBuffer.held_bytes) == (0, 0)
        attach(fds[1], exempt=True).close()
    finally:
        for fd in fds:
            os.close(fd)


def test_one_uid_holds_at_most_half_of_the_buffers_and_bytes(monkeypatch):
    other = UID + 1000
    fds = [sealed(3 * 4096) for _ in range(5)]
    os.fchown(fds[3], other, -1)                               # memfds of another uid
    os.fchown(fds[4], other, -1)
    held: list[LogitsBuffer] = []
    try:
        monkeypatch.setattr(lb, "max_live", lambda: 4)         # 2 a uid
        held += [attach(fds[0]), attach(fds[1])]
        assert refusal(fds[2]) == "EMFILE"                     # this uid's third
        held.append(attach(fds[3], uid=other))                 # another uid's first
        assert LogitsBuffer.of_uid == {UID: (2, 6 * 4096), other: (1, 3 * 4096)}
        held.append(attach(fds[2], exempt=True))               # predd's own uid: no share
        for buf in held:
            buf.close()
        held.clear()
        assert LogitsBuffer.of_uid == {}
        monkeypatch.setattr(lb, "max_bytes", lambda: 8 * 4096)   # 4 pages a uid
        held.append(attach(fds[0]))
        assert refusal(fds[1]) == "ENOMEM"                     # 6 pages > 4
        held.append(attach(fds[4], uid=other))
        assert (LogitsBuffer.live, LogitsBuffer.held_bytes) == (2, 6 * 4096)
    finally:
        for buf in held:
            buf.close()
        for fd in fds:
            os.close(fd)
    assert (LogitsBuffer.live, LogitsBuffer.held_bytes, LogitsBuffer.of_uid) == (0, 0, {})


def test_open_file_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        assert lb.max_live() == min(soft, 256) // 8
        assert lb.raise_open_file_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert lb.max_live() == hard // 8
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_predd_holds_its_own_duplicate_and_a_punched_hole_drops_the_buffer():
    client = ClientBuffer.create(VOCAB, slots=2)
    buf = attach(client.fd, slots=2)
    hole = os.dup(client.fd)
    client.close_fd()                       # the client may close its descriptor
    try:
        row = np.full(VOCAB, 2.5, np.float32)
        assert buf.write(0, row)
        libc = ctypes.CDLL(None, use_errno=True)
        punch = 0x01 | 0x02                 # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
        assert libc.fallocate(hole, punch, ctypes.c_long(0), ctypes.c_long(4096)) == 0
        assert not buf.write(1, row)            # predd would allocate the hole: no more
        assert buf.closed and LogitsBuffer.live == 0
    finally:
        buf.close()
        client.close()
        os.close(hole)


# ---------------------------------------------------------------- liblip's half

def test_client_reads_a_copy_of_its_slot():
    client = ClientBuffer.create(VOCAB, slots=3)
    predd = attach(client.fd)
    row = np.linspace(-1, 1, VOCAB, dtype=np.float32)
    with client.slot() as slot:
        assert slot == 0
        assert predd.write(slot, row)
        got = client.row(slot, VOCAB)
    assert np.array_equal(got, row)
    predd.write(0, np.zeros(VOCAB, np.float32))
    assert np.array_equal(got, row)         # a later write does not change what was read
    predd.close()
    client.close()
    with pytest.raises(OSError):            # closed: no row, and no slot
        client.row(0, VOCAB)
    with client.slot() as slot:
        assert slot == -1


def test_slots_lowest_first_given_back_or_retired():
    buf = ClientBuffer.create(VOCAB, slots=3)
    with buf.slot() as a, buf.slot() as b:
        assert (a, b) == (0, 1)
    with pytest.raises(LipError):           # predd replied with an error: given back
        with buf.slot() as c:
            assert c == 0
            err = LipError("EINVAL", "bad")
            err.from_predd = True
            raise err
    with pytest.raises(LipError):           # no reply came: predd may still write it
        with buf.slot() as d:
            assert d == 0
            raise LipError("ETIMEDOUT", "no reply")
    with pytest.raises(KeyboardInterrupt):
        with buf.slot() as e:
            assert e == 1
            raise KeyboardInterrupt
    with buf.slot() as f, buf.slot() as g:
        assert (f, g) == (2, -1)            # 0 and 1 retired, 2 taken: a frame for g
    buf.close()
