"""liblip's client on the local stream (liblip/client.py, `Client._alone`) against a stub
predd that serves the stream socket from a thread: a thread that calls alone has its
request written and its reply read on its own thread, the short way; a refusal raises
its errno; a reply slower than half a ping interval, another thread's call, and a stream
that closes each hand the call to the general path, which answers it (or fails it with
EIO), and the client goes on."""
from __future__ import annotations

import os
import select
import socket
import threading
import time

import msgpack
import numpy as np
import pytest

from liblip.client import Client, LipError
from symphony_protocol.stream import Reader, frame, stream_path


class StreamStub:
    """Answers `hello`; `pred` echoes its tokens as a frame (after `delay_s` when the
    request says so); `fail` is refused ENOENT; `close` closes the connection."""

    def __init__(self, tmp_path) -> None:
        self.addr = f"ipc://{tmp_path}/stub.sock"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(stream_path(self.addr))
        self.listener.listen(8)
        self.stop = threading.Event()
        self.ops: list[str] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conns: dict[int, tuple[socket.socket, Reader]] = {}
        late: list[tuple[float, socket.socket, list]] = []
        while not self.stop.is_set():
            ready, _, _ = select.select([self.listener, *[c for c, _ in conns.values()]],
                                        [], [], 0.005)
            now = time.monotonic()
            for due, conn, message in [x for x in late if x[0] <= now]:
                late.remove((due, conn, message))
                conn.sendmsg(frame(message))
            for sock in ready:
                if sock is self.listener:
                    conn, _ = self.listener.accept()
                    conns[conn.fileno()] = (conn, Reader(1 << 20))
                    continue
                conn, reader = conns[sock.fileno()]
                data = conn.recv(1 << 16)
                if not data:
                    del conns[conn.fileno()]
                    conn.close()
                    continue
                for message in reader.feed(data):
                    req = msgpack.unpackb(message[0])
                    rid, op = req["rid"], req["op"]
                    self.ops.append(op)
                    if rid == -1:            # a ping, or a reconnection's hello
                        continue
                    if op == "close":
                        del conns[conn.fileno()]
                        conn.close()
                        break
                    reply = {"ok": True, "rid": rid, "session": 1}
                    out = []
                    if op == "pred":
                        out = [np.array(req["tokens"], np.float32).tobytes()]
                    elif op == "fail":
                        reply = {"ok": False, "rid": rid,
                                 "error": {"code": "ENOENT", "message": "no"}}
                    answer = [msgpack.packb(reply), *out]
                    if req.get("delay_s"):
                        late.append((now + req["delay_s"], conn, answer))
                    else:
                        conn.sendmsg(frame(answer))
        for conn, _ in conns.values():
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def stub(tmp_path):
    s = StreamStub(tmp_path)
    yield s
    s.close()


def pred(client: Client, tokens: list[int], **fields) -> list[int]:
    _, frames = client.request("pred", tokens=tokens, **fields)
    return np.frombuffer(frames[0], np.float32).astype(int).tolist()


@pytest.fixture
def general(monkeypatch):
    """How many calls took the general path's wait (`Client._get`)."""
    taken = []
    get = Client._get

    def counted(self, rid, inbox, timeout):
        taken.append(rid)
        return get(self, rid, inbox, timeout)
    monkeypatch.setattr(Client, "_get", counted)
    return taken


def test_a_lone_caller_goes_the_short_way_and_a_refusal_raises_its_errno(stub, general):
    client = Client(stub.addr)
    try:
        assert client._stream is not None
        assert [pred(client, [i, i + 1]) for i in range(50)] == \
            [[i, i + 1] for i in range(50)]
        with pytest.raises(LipError) as refused:
            client.request("fail")
        assert refused.value.code == "ENOENT"
        assert pred(client, [7]) == [7]
        assert general == [] and client._waiting == {}
    finally:
        client.close()


def test_a_slow_reply_is_waited_for_on_the_general_path(stub, general):
    client = Client(stub.addr, lease_s=0.3)         # half a ping interval: 50 ms
    try:
        assert pred(client, [1, 2], delay_s=0.2) == [1, 2]
        assert len(general) == 1
        assert pred(client, [3]) == [3] and len(general) == 1
    finally:
        client.close()


def test_another_threads_call_is_sent_while_a_lone_caller_waits(stub):
    client = Client(stub.addr)
    try:
        done: dict[str, tuple[float, list[int]]] = {}

        def slow() -> None:
            got = pred(client, [9, 9], delay_s=0.3)
            done["slow"] = time.monotonic(), got
        thread = threading.Thread(target=slow)
        thread.start()
        time.sleep(0.05)                              # the first call waits, the short way
        got = pred(client, [4])
        done["quick"] = time.monotonic(), got
        thread.join(5)
        assert done["quick"][1] == [4] and done["slow"][1] == [9, 9]
        assert done["quick"][0] < done["slow"][0]      # not held behind the slow one
        assert pred(client, [5]) == [5]
    finally:
        client.close()


def test_a_stream_that_closes_fails_the_call_with_eio_and_the_next_call_reconnects(stub):
    client = Client(stub.addr)
    try:
        with pytest.raises(LipError) as failed:
            client.request("close")
        assert failed.value.code == "EIO"
        assert pred(client, [6]) == [6]
        assert stub.ops.count("hello") == 2             # a new session
    finally:
        client.close()


def test_the_short_way_is_not_taken_with_a_timeout_or_frames(stub, general):
    client = Client(stub.addr)
    try:
        assert pred(client, [1], timeout=5.0) == [1]
        client.request("noop", frames=(b"x",))
        assert len(general) == 2
    finally:
        client.close()
    assert os.path.exists(stream_path(stub.addr))
