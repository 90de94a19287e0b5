"""predd's local stream socket on the real predd: liblip uses it on ipc and falls back
to ZeroMQ when told to, both give the same tokens; the kernel names the peer; a closed
stream ends its session at once; malformed or oversized input closes only its own
connection; a ZeroMQ peer cannot take a stream's kind of identity."""
from __future__ import annotations

import os
import socket
import struct
import time

import msgpack
import pytest
import zmq

from liblip.client import Client, LipError
from symphony_protocol.stream import Reader, frame, stream_path


class StreamPeer:
    """A bare connection to the stream socket, framing by hand."""

    def __init__(self, addr: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(stream_path(addr))
        self.reader = Reader(1 << 30)
        self.got: list[list[bytes]] = []

    def send(self, op: str, rid: int, **fields) -> None:
        self.sock.sendmsg(frame([msgpack.packb({"op": op, "rid": rid, **fields})]))

    def recv(self) -> dict:
        while not self.got:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError
            self.got += self.reader.feed(data)
        return msgpack.unpackb(self.got.pop(0)[0])

    def closed(self) -> bool:
        try:
            return self.sock.recv(1 << 16) == b""
        except ConnectionResetError:
            return True


def sessions(lip) -> dict[int, dict]:
    return {row["session"]: row for row in lip.ps()}


def test_liblip_uses_the_stream_and_zmq_on_request_with_the_same_tokens(lip, predd,
                                                                        monkeypatch):
    prompt = lip.tokenize("The capital of France is")
    streamed = Client(predd.addr)
    monkeypatch.setenv("LIBLIP_TRANSPORT", "zmq")
    zmq_client = Client(predd.addr)
    try:
        rows = sessions(lip)
        assert rows[streamed.session["session"]]["transport"] == "stream"
        assert rows[zmq_client.session["session"]]["transport"] == "zmq"
        assert rows[streamed.session["session"]]["pid"] == os.getpid()
        assert rows[streamed.session["session"]]["via"] == "kernel"
        tokens = []
        for client in (streamed, zmq_client):
            cap = client.call("kv_create")["cap"]
            out = client.call("generate", cap=cap, tokens=prompt, max_tokens=6, stream=False,
                              sample={"temperature": 0.0})
            tokens.append(out["tokens"])
            client.call("kv_free", cap=cap)
        assert tokens[0] == tokens[1] and len(tokens[0]) == 6
        times = lip.stats()["time_ms"]    # predd's CPU in messages never exceeds their wall
        assert 0 < times["requests_cpu"] <= times["requests"] + 1.0
    finally:
        streamed.close()
        zmq_client.close()


def test_closing_the_stream_ends_the_session_at_once(lip, predd):
    peer = StreamPeer(predd.addr)
    peer.send("hello", 1, client="stream-test", lease_s=600.0)
    hello = peer.recv()
    assert hello["ok"] and hello["rid"] == 1
    peer.send("kv_create", 2)
    assert peer.recv()["ok"]
    sid = hello["session"]
    assert sessions(lip)[sid]["objects"] == 1
    peer.sock.close()
    deadline = time.monotonic() + 10
    while sid in sessions(lip):         # a 600 s lease: only the close can end it
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_kernel_names_a_stream_peer(lip, predd):
    peer = StreamPeer(predd.addr)
    peer.send("hello", 1, uid=os.getuid() + 1)
    reply = peer.recv()
    assert not reply["ok"] and reply["error"]["code"] == "EPERM"
    peer.sock.close()


@pytest.mark.parametrize("head", [
    struct.pack("<I", 0),                      # no frames
    struct.pack("<I", 1000),                   # too many frames
    struct.pack("<2I", 1, 2**32 - 1),          # longer than any request may be
])
def test_bad_framing_closes_only_its_own_connection(lip, predd, head):
    bystander = StreamPeer(predd.addr)
    bystander.send("info", 1)
    assert bystander.recv()["ok"]
    peer = StreamPeer(predd.addr)
    peer.sock.sendall(head)
    assert peer.closed()
    bystander.send("info", 2)
    assert bystander.recv()["rid"] == 2
    bystander.sock.close()


def test_a_stream_that_reads_no_replies_does_not_hold_predd(lip, predd):
    idle = StreamPeer(predd.addr)
    idle.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for rid in range(1, 3001):                # far more replies than the socket holds
        idle.send("info", rid)
    started = time.monotonic()
    assert lip.info()["vocab_size"] == 49152
    assert time.monotonic() - started < 30
    idle.sock.close()


def test_a_zmq_peer_cannot_take_a_streams_kind_of_identity(lip, predd):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"\x01" + b"x" * 16)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(predd.addr)
    sock.send(msgpack.packb({"op": "hello", "rid": 1}))
    assert sock.poll(1500) == 0            # dropped unanswered: never bound to a session
    sock.close(0)
    ctx.term()


def test_a_call_in_flight_when_the_stream_closes_fails_with_eio(predd):
    client = Client(predd.addr, name="reconnects", lease_s=30.0)
    try:
        client._stream.shutdown(socket.SHUT_RDWR)   # as if predd went away
        with pytest.raises(LipError) as exc:
            client.call("info", timeout=10)
        assert exc.value.code == "EIO"
        assert client.call("info")["vocab_size"] == 49152   # the next call connects again
        rows = [r for r in client.call("ps")["sessions"] if r["pid"] == os.getpid()
                and r["client"] == "reconnects"]          # ...with its hello first
        assert len(rows) == 1 and rows[0]["session"] != client.session["session"]
    finally:
        client.close()


def test_leases_still_end_while_a_stream_trickles(lip, predd):
    """A stream that sends a byte now and then (never a whole message) must not stop
    predd from ending the sessions whose lease ran out."""
    quiet = zmq.Context()
    sock = quiet.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(predd.addr)
    sock.send(msgpack.packb({"op": "hello", "rid": 1, "lease_s": 1.0}))
    assert sock.poll(30000)
    sid = msgpack.unpackb(sock.recv())["session"]
    trickle = StreamPeer(predd.addr)
    trickle.sock.sendall(struct.pack("<2I", 1, 1 << 20))    # a message that never ends
    deadline = time.monotonic() + 20
    while sid in sessions(lip):
        assert time.monotonic() < deadline
        trickle.sock.send(b"x")
        time.sleep(0.05)
    trickle.sock.close()
    sock.close(0)
    quiet.term()


def test_a_flood_on_one_stream_leaves_room_for_others(lip, predd):
    """Thousands of requests in one write are handled a bounded number per turn: a
    bystander's call is answered, and every request of the flood gets its own reply,
    in order."""
    flood = StreamPeer(predd.addr)
    flood.sock.sendall(b"".join(b"".join(frame([msgpack.packb({"op": "ping", "rid": rid})]))
                                for rid in range(1, 5001)))
    assert lip.info()["vocab_size"] == 49152
    rids = [flood.recv()["rid"] for _ in range(5000)]
    assert rids == list(range(1, 5001))
    flood.sock.close()


def test_a_request_answered_before_it_was_sent_is_never_sent(predd):
    """A call handed to the reader, then failed (the stream closed meanwhile, say),
    must not reach predd later: its kv_create would make an object no one holds."""
    import threading
    client = Client(predd.addr)
    try:
        client._sock_lock.acquire()                  # the socket busy: the call is handed on
        got: list[str] = []

        def call() -> None:
            try:
                client.call("kv_create")
            except LipError as exc:
                got.append(exc.code)

        caller = threading.Thread(target=call)
        caller.start()
        deadline = time.monotonic() + 10
        while not client._waiting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)                              # handed to the reader by now
        client._fail_all(LipError("EIO", "failed before it was sent"))
        caller.join(10)
        assert got == ["EIO"]
        client._sock_lock.release()
        time.sleep(0.5)                              # the keeper has read the hand-off
        client.call("info")                          # and anything sent is answered
        mine = [r for r in client.call("ps")["sessions"]
                if r["session"] == client.session["session"]]
        assert mine[0]["objects"] == 0
    finally:
        client.close()


def test_threads_sharing_a_stream_client_get_their_own_tokens(predd):
    """Calls handed from thread to thread (the reader's queue and eventfd) on the stream:
    each thread's greedy tokens are the ones it gets alone, and a close() racing the
    callers ends each of them with its answer or EBADF, none hanging."""
    import threading
    client = Client(predd.addr)
    try:
        def decode(first: int, out: list) -> None:
            cap = client.call("kv_create")["cap"]
            step = [first, 11, 12]
            for _ in range(6):
                token = client.call("pred", cap=cap, tokens=step,
                                    sample={"temperature": 0.0})["token"]
                out.append(token)
                step = [token]
            client.call("kv_free", cap=cap)
        together = {k: [] for k in range(6)}
        pool = [threading.Thread(target=decode, args=(100 + k, together[k])) for k in together]
        for t in pool:
            t.start()
        for t in pool:
            t.join(60)
        assert not any(t.is_alive() for t in pool)
        for k, tokens in together.items():
            alone: list[int] = []
            decode(100 + k, alone)
            assert tokens == alone and len(alone) == 6
        ended: list[str] = []

        def keep_calling() -> None:
            try:
                while True:
                    client.call("info")
            except LipError as exc:
                ended.append(exc.code)
        callers = [threading.Thread(target=keep_calling) for _ in range(4)]
        for t in callers:
            t.start()
        time.sleep(0.2)
        client.close()
        for t in callers:
            t.join(10)
        assert not any(t.is_alive() for t in callers)
        assert ended == ["EBADF"] * 4
    finally:
        client.close()
