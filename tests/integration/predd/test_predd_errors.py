"""Bad input gets a clear errno-named error, and predd keeps serving after each."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from liblip.client import LipError
from tests.conftest import start_predd


@pytest.fixture
def raw(predd):
    """A bare DEALER socket speaking to predd, for frames liblip would never send."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20000)
    sock.connect(predd.addr)

    def ask(*frames: bytes) -> dict:
        sock.send_multipart(list(frames))
        return msgpack.unpackb(sock.recv_multipart()[0])

    yield ask
    sock.close(0)
    ctx.term()


def still_serving(lip) -> None:
    kv = lip.kv_create()
    assert lip.pred(kv, [1, 2, 3]).logits.shape == (49152,)
    lip.kv_close(kv)


def pack(obj) -> bytes:
    return msgpack.packb(obj)


@pytest.mark.parametrize("frame, code", [
    (b"\xc1\xff garbage", "EBADMSG"),          # not msgpack
    (pack([1, 2, 3]), "EBADMSG"),              # not a map
    (pack({"op": "pred"}), "EINVAL"),          # no rid
    (pack({"rid": 1}), "EINVAL"),              # no op
    (pack({"rid": 1, "op": "format_disk"}), "ENOSYS"),
    (pack({"rid": 1, "op": "tokenize", "text": 5}), "EINVAL"),
    (pack({"rid": 1, "op": "pred", "cap": "x", "tokens": "abc"}), "EINVAL"),
    (pack({"rid": 1, "op": "pred", "cap": "x", "tokens": [True]}), "EINVAL"),
    (pack({"rid": 1, "op": "ping", "surprise": 1}), "EINVAL"),
])
def test_malformed_requests(raw, lip, frame, code):
    reply = raw(frame)
    assert reply["ok"] is False and reply["error"]["code"] == code
    assert reply["error"]["message"]
    still_serving(lip)


def test_wrong_values(raw, lip):
    kv = lip.kv_create()
    cases = [
        ({"op": "pred", "cap": kv.cap, "tokens": [49152]}, "EINVAL"),       # out of vocab
        ({"op": "pred", "cap": kv.cap, "tokens": [1], "outputs": [3]}, "EINVAL"),
        ({"op": "pred", "cap": kv.cap, "tokens": [1], "positions": [-1]}, "EINVAL"),
        ({"op": "pred", "cap": kv.cap, "tokens": [1], "sample": {"temperature": -1.0}},
         "EINVAL"),
        ({"op": "pred", "cap": kv.cap, "tokens": [1], "mask": []}, "EINVAL"),
        ({"op": "pred", "cap": kv.cap, "tokens": []}, "EINVAL"),           # empty cache
        ({"op": "generate", "cap": kv.cap, "tokens": [1], "max_tokens": 0}, "EINVAL"),
        ({"op": "kv_truncate", "cap": kv.cap, "length": 5}, "EINVAL"),
        ({"op": "kv_extract", "cap": kv.cap, "ranges": [[0, 9]]}, "EINVAL"),
        ({"op": "kv_import"}, "EINVAL"),                                   # no frame
        ({"op": "kv_fork", "cap": kv.cap, "rights": "rwx"}, "EINVAL"),
    ]
    for i, (req, code) in enumerate(cases):
        reply = raw(pack({"rid": i, **req}))
        assert reply["rid"] == i
        assert (reply["ok"], reply["error"]["code"]) == (False, code), req
    reply = raw(pack({"rid": 99, "op": "kv_import"}), b"not an export")
    assert reply["error"]["code"] == "EINVAL"
    still_serving(lip)


def test_forged_and_read_only_capabilities(lip):
    forged = lip.KV.from_capability("0123456789abcdef0123456789abcdef")
    for call in (lambda: lip.pred(forged, [1]), lambda: lip.kv_stat(forged),
                 lambda: lip.kv_fork(forged)):
        with pytest.raises(LipError) as err:
            call()
        assert err.value.code == "EBADF"
    kv = lip.kv_create()
    lip.prefill(kv, [1, 2, 3])
    reader = lip.kv_fork(kv)   # forks are always the forker's own, read-write
    ro = lip.KV.from_capability(lip.client().call("kv_grant", cap=kv.cap, rights="r")["cap"],
                                "r")
    with pytest.raises(LipError) as err:
        lip.pred(ro, [4])
    assert err.value.code == "EACCES"
    with pytest.raises(LipError) as err:
        lip.kv_truncate(ro, 0)
    assert err.value.code == "EACCES"
    with pytest.raises(LipError) as err:   # no escalation through grant
        lip.client().call("kv_grant", cap=ro.cap, rights="rw")
    assert err.value.code == "EACCES"
    assert lip.kv_tokens(ro) == [1, 2, 3]            # r still reads and forks
    assert lip.kv_tokens(lip.kv_fork(ro)) == [1, 2, 3]
    assert lip.kv_tokens(reader) == [1, 2, 3]
    still_serving(lip)


def test_revoked_and_replayed_capabilities_are_ebadf_and_grants_die_with_theirs(lip, predd):
    """A capability replayed after kv_free or after its session ended is EBADF from any
    session; a grant made from a session's capability dies with it (so a program cannot
    keep a file's object past the open that kvfsd granted it)."""
    from liblip.client import Client
    a, b = Client(predd.addr), Client(predd.addr)
    try:
        cap = a.call("kv_create")["cap"]
        grant = a.call("kv_grant", cap=cap, rights="rw")["cap"]
        regrant = b.call("kv_grant", cap=grant, rights="r")["cap"]    # another session
        assert b.call("kv_stat", cap=regrant)["tokens"] == 0
        a.call("kv_free", cap=cap)                                   # the parent goes
        for who, token in ((a, cap), (a, grant), (b, grant), (b, regrant)):
            with pytest.raises(LipError) as err:
                who.call("kv_stat", cap=token)
            assert err.value.code == "EBADF"
        kept = a.call("kv_create")["cap"]
        a.call("bye")                                                # its session ends
        with pytest.raises(LipError) as err:
            b.call("kv_fork", cap=kept)                              # replay elsewhere
        assert err.value.code == "EBADF"
    finally:
        a.close()
        b.close()
    still_serving(lip)


@pytest.mark.slow
def test_pool_exhaustion_is_enospc(tmp_path):
    import liblip
    small = start_predd(str(tmp_path / "small"), "--kv-pages", "8", "--lease", "3",
                        "--admit-wait", "0")      # no waiting for room: ENOSPC at once
    try:
        liblip.connect(small.addr)
        kv = liblip.kv_create()
        liblip.prefill(kv, list(range(100, 200)))         # 100 tokens: 7 pages
        with pytest.raises(LipError) as err:
            liblip.prefill(kv, list(range(200, 240)))     # needs 3 more, 1 free
        assert err.value.code == "ENOSPC"
        assert liblip.kv_stat(kv)["tokens"] == 100         # nothing half-appended
        big = liblip.kv_create()
        with pytest.raises(LipError) as err:
            liblip.generate(big, list(range(1, 40)), max_tokens=5)
        assert err.value.code == "ENOSPC"
        fork = liblip.kv_fork(kv)                         # a fork needs no page...
        with pytest.raises(LipError) as err:              # ...until it writes: CoW of
            liblip.prefill(fork, [1] * 20)                # the last page + 1 more
        assert err.value.code == "ENOSPC"
        liblip.kv_close(fork)
        assert liblip.pred(kv, [5]).logits.shape == (49152,)   # the pool still serves
        assert liblip.fsck()["clean"]
    finally:
        liblip.connect(os.environ["PREDD_ADDR"])
        assert small.stop() == 0


KILLED_LIP = """
import sys, liblip as lip
kv = lip.kv_create()
lip.prefill(kv, list(range(1, 300)))
print("ready", flush=True)
while True:
    lip.pred(kv, list(range(1, 200)))
    lip.kv_truncate(kv, 299)
"""


@pytest.mark.slow
def test_client_killed_mid_pred_leaks_nothing(lip, predd):
    before = lip.stats()
    proc = subprocess.Popen([sys.executable, "-c", KILLED_LIP], stdout=subprocess.PIPE,
                            env={**os.environ, "PREDD_ADDR": predd.addr}, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)                     # it is mid-pred now (or about to be)
    during = lip.stats()
    assert during["pages_free"] < before["pages_free"]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The session ends after its lease (10 s from hello) and its objects are freed.
    deadline = time.monotonic() + 30
    while lip.stats()["pages_free"] != before["pages_free"] and time.monotonic() < deadline:
        time.sleep(0.5)
    after = lip.stats()
    assert after["pages_free"] == before["pages_free"]
    assert after["sessions"] <= before["sessions"]
    assert lip.fsck()["clean"]
    still_serving(lip)
