"""The logits buffer, both halves, in one process (its own pid stands for the client's):
predd takes only a tmpfs file the client can write (each refusal errno-named), sizes it,
writes a row at its slot and nowhere else, and falls back to a frame when the client
truncates and seals its file; liblip hands out the lowest free slot, gives it back
after a reply and retires it when no reply came."""
from __future__ import annotations

import fcntl
import os

import numpy as np
import pytest

from liblip.client import LipError
from liblip.logits_buffer import LogitsBuffer as ClientBuffer
from predd.logits_buffer import MAX_SLOTS, LogitsBuffer, slot_bytes
from tests.unit.helpers import code

VOCAB = 1000                       # 4000 bytes a row: one page a slot


def attach(fd: int, slots: int = 3) -> LogitsBuffer:
    return LogitsBuffer.attach(os.getpid(), fd, slots, VOCAB)


def test_slot_is_a_row_rounded_to_pages():
    assert slot_bytes(1000) == 4096
    assert slot_bytes(1024) == 4096
    assert slot_bytes(49152) == 196608
    assert slot_bytes(49153) == 200704


def test_attach_sizes_the_file_and_writes_only_the_named_slot():
    fd = os.memfd_create("t")
    buf = attach(fd)
    try:
        assert (buf.slots, buf.slot_bytes) == (3, 4096)
        assert os.fstat(fd).st_size == 3 * 4096
        row = np.arange(VOCAB, dtype=np.float32)
        assert buf.write(1, memoryview(row).cast("B"))
        data = np.frombuffer(os.pread(fd, 3 * 4096, 0), dtype=np.float32).reshape(3, 1024)
        assert np.array_equal(data[1, :VOCAB], row)
        assert not data[0].any() and not data[2].any() and not data[1, VOCAB:].any()
        assert not buf.write(0, memoryview(np.zeros(1025, np.float32)).cast("B"))  # > a slot
        buf.check_slot(2)
        assert code(lambda: buf.check_slot(-1)) == code(lambda: buf.check_slot(3)) == "EINVAL"
    finally:
        buf.close()
        os.close(fd)
    assert buf.fd == -1


def test_a_truncated_sealed_file_falls_back_instead_of_faulting():
    fd = os.memfd_create("t", os.MFD_ALLOW_SEALING)
    buf = attach(fd)
    try:
        os.ftruncate(fd, 0)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
        assert not buf.write(2, memoryview(np.ones(VOCAB, np.float32)).cast("B"))
        assert os.fstat(fd).st_size == 0
    finally:
        buf.close()
        os.close(fd)


def refusal(fd: int, slots: int = 3, pid: int | None = None) -> str:
    return code(lambda: LogitsBuffer.attach(os.getpid() if pid is None else pid, fd,
                                            slots, VOCAB))


def test_refusals_are_errno_named(tmp_path):
    r, w = os.pipe()
    proc = os.open("/proc/self/status", os.O_RDONLY)          # regular, not on tmpfs
    mem = os.memfd_create("t")
    readonly = os.open(f"/proc/self/fd/{mem}", os.O_RDONLY)   # tmpfs, not writable
    try:
        assert refusal(w) == "EINVAL"
        assert refusal(proc) == "EINVAL"
        assert refusal(readonly) == "EINVAL"
        assert refusal(mem, slots=0) == "EINVAL"
        assert refusal(mem, slots=MAX_SLOTS + 1) == "EINVAL"
        assert refusal(mem, pid=0) == "EOPNOTSUPP"
        assert refusal(-5) == "EBADF"
        assert refusal(65535) == "EBADF"                       # not open in the client
        assert os.fstat(mem).st_size == 0                      # nothing refused was sized
    finally:
        for fd in (r, w, proc, mem, readonly):
            os.close(fd)


def test_buffers_held_are_bounded_by_the_open_file_limit(monkeypatch):
    import predd.logits_buffer as lb
    most = LogitsBuffer.live + 1
    monkeypatch.setattr(lb, "max_live", lambda: most)
    fds = [os.memfd_create("t") for _ in range(2)]
    first = attach(fds[0])
    try:
        assert refusal(fds[1]) == "EMFILE"
        first.close()
        second = attach(fds[1])                # one was closed: room again
        second.close()
        second.close()                         # twice: counted once
    finally:
        first.close()
        for fd in fds:
            os.close(fd)


def test_open_file_limit_is_raised_to_the_hard_one():
    import resource

    from predd.logits_buffer import max_live, raise_open_file_limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        assert max_live() == min(soft, 256) // 4
        assert raise_open_file_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
        assert max_live() == hard // 4
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_predd_holds_its_own_duplicate():
    fd = os.memfd_create("t")
    buf = attach(fd)
    os.close(fd)                            # the client may close its descriptor
    try:
        assert buf.write(0, memoryview(np.ones(VOCAB, np.float32)).cast("B"))
    finally:
        buf.close()


# ---------------------------------------------------------------- liblip's half

def mapped(slots: int = 3) -> ClientBuffer:
    buf = ClientBuffer.create(slots)
    assert buf is not None
    predd = attach(buf.fd, slots)
    buf.map(predd.slot_bytes)
    assert buf.fd == -1                     # mapped: the descriptor is closed
    buf.predd = predd                       # the test writes as predd would
    return buf


def test_client_reads_a_copy_of_its_slot():
    buf = mapped()
    row = np.linspace(-1, 1, VOCAB, dtype=np.float32)
    with buf.slot() as slot:
        assert slot == 0
        assert buf.predd.write(slot, memoryview(row).cast("B"))
        got = buf.row(slot, VOCAB)
    assert np.array_equal(got, row)
    buf.predd.write(0, memoryview(np.zeros(VOCAB, np.float32)).cast("B"))
    assert np.array_equal(got, row)         # a later write does not change what was read
    buf.predd.close()


def test_slots_lowest_first_given_back_or_retired():
    buf = mapped(3)
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
    buf.predd.close()


def test_unmapped_buffer_gives_no_slot():
    buf = ClientBuffer.create(2)
    assert buf is not None
    with buf.slot() as slot:
        assert slot == -1
    buf.close()
