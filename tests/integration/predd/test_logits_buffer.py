"""The logits buffer on the real predd: liblip's raw `pred` rows come through the slot the
request names, with no frame; a hostile buffer (a pipe, an unsealed memfd, a slot out of
range, a hole punched under predd) gets its errno or frames, and predd keeps serving; predd holds a buffer exactly as long as its session."""
from __future__ import annotations

import ctypes
import fcntl
import os
import subprocess
import sys
import time

import numpy as np

from tests.integration.raw_peer import Peer

VOCAB = 49152
PROMPT = "The capital of France is"


def test_raw_pred_rows_come_through_the_buffer(lip):
    client = lip.client()
    tokens = lip.tokenize(PROMPT)
    kv = lip.kv_create()
    before = lip.stats()["logits_rows"]
    lip.pred(lip.kv_create(), tokens)         # the first raw pred sets the buffer up
    assert client.logits is not None and client.logits_refused == ""
    assert (client.logits.slots, client.logits.slot_bytes) == (16, VOCAB * 4)
    header, frames = client.request("pred", cap=kv.cap, tokens=tokens, into=5)
    assert header["logits"] == {"shape": [1, VOCAB], "dtype": "float32", "slot": 5}
    assert frames == []
    row = client.logits.row(5, VOCAB)
    framed = lip.pred_outputs(lip.kv_create(), tokens, [0, -1])[1]   # two rows: a frame
    assert row.argmax() == framed.argmax()
    assert np.abs(row - framed.logits).max() <= 1e-4

    d = lip.pred(lip.kv_create(), tokens)        # liblip's own slot
    assert d.argmax() == framed.argmax() and np.abs(d.logits - row).max() <= 1e-4
    assert lip.pred(kv, [d.argmax()]).logits.shape == (VOCAB,)
    after = lip.stats()["logits_rows"]      # 4 rows in slots, the two-row reply framed
    assert (after["buffer"] - before["buffer"], after["frame"] - before["frame"]) == (4, 2)


def sealed_memfd(size: int) -> int:
    fd = os.memfd_create("hostile", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.posix_fallocate(fd, 0, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd


def test_hostile_buffers_get_errnos_or_frames(lip, predd):
    peer = Peer(predd.addr)
    r, w = os.pipe()
    unsealed = os.memfd_create("hostile")
    os.ftruncate(unsealed, 2 * VOCAB * 4)
    mem = sealed_memfd(2 * VOCAB * 4)
    try:
        head = peer.ok("hello", logits_fd=w, logits_slots=4)
        assert head["logits_slot_bytes"] == 0
        assert head["logits_buffer"] == "EINVAL: logits_fd: not a regular file"
        head = peer.ok("hello", logits_fd=unsealed, logits_slots=2)
        assert head["logits_buffer"] == (
            "EINVAL: logits_fd: must be sealed with F_SEAL_SHRINK, F_SEAL_GROW and "
            "F_SEAL_SEAL, and not against writes")
        cap = peer.ok("kv_create")["cap"]
        peer.send("pred", cap=cap, tokens=[1, 2, 3], into=0)   # no buffer: a frame
        head, frames = peer.recv()
        assert head["ok"] and "slot" not in head["logits"] and len(frames[0]) == VOCAB * 4

        head = peer.ok("hello", logits_fd=mem, logits_slots=2)
        assert (head["logits_slot_bytes"], head["logits_buffer"]) == (VOCAB * 4, "")
        out = peer.ask("pred", cap=cap, tokens=[1, 2, 3], into=2)
        assert out["error"] == {"code": "EINVAL", "message":
                                "into: this session's logits buffer has slots 0..1"}

        peer.send("pred", cap=cap, tokens=[4], into=1)
        head, frames = peer.recv()
        assert head["logits"]["slot"] == 1 and frames == []
        row = np.frombuffer(os.pread(mem, VOCAB * 4, VOCAB * 4), dtype=np.float32).copy()
        assert row.any()

        libc = ctypes.CDLL(None, use_errno=True)       # pull the pages away under predd
        punch = 0x01 | 0x02                            # KEEP_SIZE | PUNCH_HOLE
        assert libc.fallocate(mem, punch, ctypes.c_long(0), ctypes.c_long(2 * VOCAB * 4)) == 0
        peer.send("pred", cap=cap, tokens=[], into=1)          # the same prediction again
        head, frames = peer.recv()                             # predd would fill the hole:
        assert "slot" not in head["logits"]                    # a frame, the buffer dropped
        again = np.frombuffer(frames[0], dtype=np.float32)
        assert again.argmax() == row.argmax() and np.abs(again - row).max() <= 1e-4
        assert os.fstat(mem).st_blocks == 0                    # predd allocated nothing
        peer.ok("bye")
    finally:
        peer.close()
        for fd in (r, w, unsealed, mem):
            os.close(fd)
    assert lip.pred(lip.kv_create(), [1, 2, 3]).logits.shape == (VOCAB,)


def buffers_held(predd) -> int:
    """How many liblip logits buffers predd holds (the memfds its descriptors name)."""
    fds = f"/proc/{predd.proc.pid}/fd"
    held = set()
    for name in os.listdir(fds):
        try:
            if os.readlink(f"{fds}/{name}").startswith("/memfd:liblip-logits"):
                held.add(os.stat(f"{fds}/{name}").st_ino)
        except OSError:
            pass
    return len(held)


def test_predd_holds_a_buffer_as_long_as_its_session(lip, predd):
    from liblip.client import Client
    before = buffers_held(predd)
    other = Client(predd.addr)
    assert buffers_held(predd) == before    # none until a raw pred asks
    assert other.logits_buffer() is not None
    assert buffers_held(predd) == before + 1
    other.close()                           # bye
    assert buffers_held(predd) == before

    killed = subprocess.Popen(
        [sys.executable, "-c", "import liblip, sys; liblip.connect(sys.argv[1]); "
         "liblip.pred(liblip.kv_create(), [1, 2]); "
         "print(liblip.client().logits is not None, flush=True); input()", predd.addr],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline() == "True\n"
    assert buffers_held(predd) == before + 1
    killed.kill()
    killed.wait()
    deadline = time.monotonic() + 15        # the lease (3 s in the tests) runs out
    while buffers_held(predd) != before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert buffers_held(predd) == before


def test_a_client_with_every_slot_taken_grows_its_buffer_once(lip, predd):
    client = lip.client()
    tokens = lip.tokenize(PROMPT)
    want = lip.pred_outputs(lip.kv_create(), tokens, [0, -1])[1]     # a frame
    small = client.logits_buffer()
    assert small is not None and small.slots == 16
    held = buffers_held(predd)
    taken = [small.slot() for _ in range(16)]
    assert [t.__enter__() for t in taken] == list(range(16))
    d = lip.pred(lip.kv_create(), tokens)          # no slot free: a frame, then a bigger one
    assert d.argmax() == want.argmax()
    assert client.logits is not small and client.logits.slots == 64
    assert buffers_held(predd) == held             # predd swapped the session's buffer
    for t in taken:
        t.__exit__(None, None, None)
    again = lip.pred(lip.kv_create(), tokens)      # through the bigger buffer's slot 0
    assert np.abs(again.logits - want.logits).max() <= 1e-4
    assert client.logits_buffer(grow=True) is client.logits       # only once
