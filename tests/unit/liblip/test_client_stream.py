"""liblip's client on the local stream (liblip/client.py, `Client._alone`) against a stub
predd that serves the stream socket from a thread: a thread that calls alone has its
request written and its reply read on its own thread, the short way; a refusal raises
its errno; a reply slower than half a ping interval, another thread's call, and a stream
that closes each hand the call to the general path, which answers it (or fails it with
EIO), and the client goes on."""
from __future__ import annotations

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
    request says so); `fail` is refused ENOENT; `close` closes the connection; `twice`
    answers twice in one write (n 1, then 2); `trickle` sends replies to no one's rid
    every 20 ms for `delay_s`, then its own."""

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
                try:
                    conn.sendmsg(frame(message))
                except OSError:              # the client went
                    pass
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
                    if op == "twice":
                        conn.sendmsg([*frame([msgpack.packb(dict(reply, n=1))]),
                                      *frame([msgpack.packb(dict(reply, n=2))])])
                    elif op == "trickle":
                        for k in range(int(req["delay_s"] / 0.02)):
                            late.append((now + 0.02 * k, conn,
                                         [msgpack.packb({"ok": True, "rid": 10**9 + k})]))
                        late.append((now + req["delay_s"], conn, answer))
                    elif req.get("delay_s"):
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
    general.clear()
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
    client = Client(stub.addr, lease_s=3.0)         # half a ping interval: 0.5 s
    general.clear()
    try:
        assert pred(client, [1, 2], delay_s=2.0) == [1, 2]
        assert len(general) == 1
    finally:
        client.close()


def test_replies_to_others_do_not_keep_a_call_from_its_pings(stub):
    """Replies that are not the call's keep coming; the call still goes to the general
    path after half a ping interval, which pings on time."""
    client = Client(stub.addr, lease_s=0.6)         # a ping every 0.2 s
    try:
        pings = stub.ops.count("ping")
        client.request("trickle", delay_s=1.5)
        assert stub.ops.count("ping") - pings >= 4
    finally:
        client.close()


def test_the_first_reply_wins_and_an_interrupt_leaves_nothing_waiting(stub, monkeypatch):
    client = Client(stub.addr)
    try:
        assert client.request("twice")[0]["n"] == 1
        poller = client._poller

        class Interrupted:              # Ctrl-C while the call waits in poll
            def poll(self, *args):
                raise KeyboardInterrupt

            def __getattr__(self, name):
                return getattr(poller, name)
        monkeypatch.setattr(client, "_poller", Interrupted())
        with pytest.raises(KeyboardInterrupt):
            pred(client, [1])
        monkeypatch.setattr(client, "_poller", poller)
        assert client._waiting == {} and not client._sock_lock.locked()
        assert pred(client, [2]) in ([1], [2])      # the interrupted call's reply may come
    finally:
        client.close()


def test_another_threads_call_is_sent_while_a_lone_caller_waits(stub, monkeypatch):
    client = Client(stub.addr)
    alone = threading.Event()
    short = Client._alone

    def entered(self, op, fields):
        alone.set()
        return short(self, op, fields)
    monkeypatch.setattr(Client, "_alone", entered)
    try:
        done: dict[str, tuple[float, list[int]]] = {}

        def slow() -> None:
            got = pred(client, [9, 9], delay_s=0.4)
            done["slow"] = time.monotonic(), got
        alone.clear()
        thread = threading.Thread(target=slow)
        thread.start()
        assert alone.wait(5)                          # the first call waits, the short way
        time.sleep(0.02)
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
