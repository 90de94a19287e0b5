"""liblip's client (liblip/client.py) against a stub predd: a ROUTER socket in a thread
that answers `hello`, echoes `pred`'s tokens back as a frame, streams `gen`, and can be
told to go silent or away. Replies reach the call that asked, from one thread or many;
a stream arrives in order; a dead or silent predd fails waiting calls with EIO; a
timeout leaves the client usable; close() fails a call still waiting with EBADF."""
from __future__ import annotations

import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from liblip.client import Client, LipError


class Stub:
    def __init__(self, tmp_path) -> None:
        self.addr = f"ipc://{tmp_path}/stub.sock"
        self.silent = threading.Event()      # read requests, answer none
        self.stop = threading.Event()
        self.ops: list[str] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.addr)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            ident, head, *frames = self.sock.recv_multipart()
            req = msgpack.unpackb(head)
            if self.silent.is_set():
                continue
            rid, op = req["rid"], req["op"]
            self.ops.append(op)
            reply = {"ok": True, "rid": rid}
            if op == "pred":
                out = [np.array(req["tokens"], np.float32).tobytes()]
            elif op == "gen":
                for i in range(3):
                    self.sock.send_multipart(
                        [ident, msgpack.packb({"ok": True, "rid": rid, "i": i, "more": True})])
                reply["i"], out = 3, []
            elif op == "failgen":
                self.sock.send_multipart(
                    [ident, msgpack.packb({"ok": True, "rid": rid, "i": 0, "more": True})])
                reply = {"ok": False, "rid": rid, "error": {"code": "ENOSPC", "message": "full"}}
                out = []
            elif op == "fail":
                reply = {"ok": False, "rid": rid, "error": {"code": "ENOENT", "message": "no"}}
                out = []
            else:
                out = []
            self.sock.send_multipart([ident, msgpack.packb(reply), *out])
        self.sock.close(0)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.ctx.term()


@pytest.fixture
def stub(tmp_path):
    s = Stub(tmp_path)
    yield s
    s.close()


def pred(client: Client, tokens: list[int]) -> list[int]:
    _, frames = client.request("pred", tokens=tokens)
    assert isinstance(frames[0], bytes)
    return np.frombuffer(frames[0], np.float32).astype(int).tolist()


def test_one_thread_gets_each_reply_and_errors_by_name(stub):
    client = Client(stub.addr)
    try:
        for i in range(200):
            assert pred(client, [i, i + 1]) == [i, i + 1]
        with pytest.raises(LipError) as err:
            client.call("fail")
        assert err.value.code == "ENOENT"
        assert pred(client, [7]) == [7]
    finally:
        client.close()


@pytest.mark.parametrize("threads", [2, 16, 64])
def test_many_threads_each_get_their_own_replies(stub, threads):
    client = Client(stub.addr)
    wrong: list = []

    def work(k: int) -> None:
        for i in range(40):
            got = pred(client, [k, i])
            if got != [k, i]:
                wrong.append((k, i, got))
    try:
        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(60)
        assert not any(t.is_alive() for t in pool) and wrong == []
        assert client._waiting == {}
    finally:
        client.close()


def test_a_stream_arrives_in_order_beside_other_calls(stub):
    client = Client(stub.addr)
    try:
        other = threading.Thread(target=lambda: [pred(client, [i]) for i in range(50)])
        other.start()
        assert [h["i"] for h in client.stream("gen")] == [0, 1, 2, 3]
        other.join(30)
    finally:
        client.close()


def test_a_delivered_stream_is_handled_on_the_reading_thread_in_order(stub):
    """stream_into: the replies before the last go to on_reply on the thread that reads
    (not the caller's), in order, beside other calls; the last is returned."""
    client = Client(stub.addr)
    seen: list[tuple[int, str]] = []
    try:
        other = threading.Thread(target=lambda: [pred(client, [i]) for i in range(50)])
        other.start()
        last = client.stream_into(
            "gen", lambda h: seen.append((h["i"], threading.current_thread().name)))
        other.join(30)
        assert last["i"] == 3 and [i for i, _ in seen] == [0, 1, 2]
        assert threading.current_thread().name not in {name for _, name in seen}
        assert client._waiting == {} and client._delivering == 0
    finally:
        client.close()


def test_a_delivered_stream_left_or_failed_is_cancelled_and_raises(stub):
    """on_reply returning False cancels the call in predd and drops what follows; one
    that raises cancels it too and its exception reaches the caller; an error reply
    is raised by its errno."""
    client = Client(stub.addr)
    try:
        seen: list[int] = []
        last = client.stream_into("gen", lambda h: seen.append(h["i"]) or False)
        assert seen == [0] and last["i"] == 3 and "cancel" in stub.ops

        def broken(header: dict) -> bool:
            raise ValueError("the program's own bug")
        stub.ops.clear()
        with pytest.raises(ValueError, match="own bug"):
            client.stream_into("gen", broken)
        assert "cancel" in stub.ops
        with pytest.raises(LipError) as err:
            client.stream_into("failgen", lambda h: True)
        assert err.value.code == "ENOSPC" and err.value.from_predd
        assert pred(client, [5]) == [5]
        assert client._waiting == {} and client._delivering == 0
    finally:
        client.close()


def test_a_timeout_leaves_the_client_usable(stub):
    client = Client(stub.addr)
    try:
        stub.silent.set()
        with pytest.raises(LipError) as err:
            client.call("pred", timeout=0.2, tokens=[1])
        assert err.value.code == "ETIMEDOUT"
        stub.silent.clear()
        assert pred(client, [3]) == [3]
        assert client._waiting == {}
    finally:
        client.close()


@pytest.mark.parametrize("threads", [1, 4])
def test_a_predd_that_goes_away_fails_waiting_calls_with_eio(stub, threads):
    client = Client(stub.addr, dead_after_s=0.5)
    errors: list = []

    def wait() -> None:
        try:
            client.call("pred", tokens=[1])
        except LipError as exc:
            errors.append(exc)
    try:
        stub.silent.set()
        pool = [threading.Thread(target=wait) for _ in range(threads)]
        for t in pool:
            t.start()
        time.sleep(0.1)
        started = time.monotonic()
        stub.close()                                # the socket goes: disconnected
        for t in pool:
            t.join(10)
        assert time.monotonic() - started < 3.0
        assert [(e.code, "unreachable" in str(e)) for e in errors] == [("EIO", True)] * threads
    finally:
        client._shutdown()


def test_a_silent_predd_fails_a_waiting_call_with_eio(stub):
    client = Client(stub.addr, silent_after_s=0.5)
    try:
        stub.silent.set()                           # connected, never answers (nor pings)
        started = time.monotonic()
        with pytest.raises(LipError) as err:
            client.call("pred", tokens=[1])
        assert err.value.code == "EIO" and "not answering" in str(err.value)
        assert 0.4 < time.monotonic() - started < 3.0
    finally:
        client._shutdown()


def test_close_fails_a_call_still_waiting_with_ebadf(stub):
    client = Client(stub.addr)
    errors: list = []

    def wait() -> None:
        try:
            client.call("pred", tokens=[1])
        except LipError as exc:
            errors.append(exc.code)
    stub.silent.set()
    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    client._shutdown()
    waiter.join(5)
    assert not waiter.is_alive() and errors == ["EBADF"]
    with pytest.raises(LipError) as err:
        client.call("ping")
    assert err.value.code == "EBADF"
