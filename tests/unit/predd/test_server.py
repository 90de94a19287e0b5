"""The server loop's door, with a fake engine: every message arrives with its sender's
kernel credentials, a flood is drained in bounded turns, and an oversized frame never
reaches the engine."""
from __future__ import annotations

import os
import time

import pytest
import zmq

from predd.engine.metrics import Counters
from predd.server import loop as server_mod
from predd.server.identity import Peer
from predd.server.loop import Server


class FakeEngine:
    max_message_bytes = 1000

    def __init__(self) -> None:
        self.seen: list[tuple[bytes, list[bytes], Peer]] = []
        self.counters = Counters()

    def handle(self, identity: bytes, frames: list[bytes], now: float, peer: Peer) -> None:
        self.seen.append((identity, frames, peer))
        self.counters.requests += 1

    def release_held(self) -> None:
        pass


@pytest.fixture
def server(tmp_path):
    engine = FakeEngine()
    srv = Server(f"ipc://{tmp_path}/predd.sock", lambda send, log: engine, log=lambda m: None)
    yield srv
    srv.close()


def dealer(addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(addr)
    return sock


def drain_until(srv: Server, done, turns: list[int] | None = None, limit_s: float = 10.0):
    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        if srv.sock.poll(100, zmq.POLLIN):
            before = len(srv.engine.seen)
            srv._drain()
            if turns is not None:
                turns.append(len(srv.engine.seen) - before)
    assert done(), "messages did not arrive"


def test_each_message_carries_the_senders_kernel_credentials(server):
    sock = dealer(server.addr)
    sock.send_multipart([b"header", b"blob"])
    drain_until(server, lambda: server.engine.seen)
    identity, frames, peer = server.engine.seen[0]
    assert frames == [b"header", b"blob"] and identity
    assert (peer.uid, peer.gid, peer.pid) == (os.getuid(), os.getgid(), os.getpid())
    assert peer.kernel and peer.address == f"localhost:{os.getuid()}:{os.getgid()}:{os.getpid()}"
    sock.close()


def test_a_flood_is_drained_in_bounded_turns(server, monkeypatch):
    monkeypatch.setattr(server_mod, "DRAIN_MAX", 10)
    monkeypatch.setattr(server_mod, "DRAIN_S", 60.0)
    sock = dealer(server.addr)
    for i in range(95):
        sock.send(b"%d" % i)
    turns: list[int] = []
    drain_until(server, lambda: len(server.engine.seen) == 95, turns)
    assert max(turns) == 10 and len(turns) >= 10
    assert [f[0] for _, f, _ in server.engine.seen] == [b"%d" % i for i in range(95)]
    sock.close()


def test_a_turns_time_is_read_once_not_once_a_message(server, monkeypatch):
    """The thread's CPU clock is a system call: a turn of 20 messages reads it twice and
    counts the difference, in `requests_cpu`, once."""
    ticks = iter([10.0, 10.25])
    reads: list[float] = []
    monkeypatch.setattr(server_mod.time, "thread_time", lambda: reads.append(0) or next(ticks))
    sock = dealer(server.addr)
    for i in range(20):
        sock.send(b"%d" % i)
    deadline = time.monotonic() + 10
    while server.sock.poll(0, zmq.POLLIN) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)              # all 20 queued in the socket
    server._drain()
    assert len(server.engine.seen) == 20 and len(reads) == 2
    assert server.engine.counters.time_s["requests_cpu"] == 0.25
    assert server.engine.counters.time_s["requests"] > 0
    ticks = iter([11.0, 12.0])
    server._drain()                      # nothing waiting: a turn not counted
    assert server.engine.counters.time_s["requests_cpu"] == 0.25
    sock.close()


def test_an_oversized_frame_never_reaches_the_engine(server):
    big = dealer(server.addr)
    big.send(b"x" * 1001)
    time.sleep(0.2)
    small = dealer(server.addr)
    small.send(b"y" * 1000)                       # exactly the limit: fine
    drain_until(server, lambda: server.engine.seen)
    server.sock.poll(200, zmq.POLLIN)
    server._drain()
    assert [f for _, f, _ in server.engine.seen] == [[b"y" * 1000]]
    big.close()
    small.close()


def test_socket_limits_are_finite(server):
    assert server.sock.getsockopt(zmq.SNDHWM) == server_mod.HWM
    assert server.sock.getsockopt(zmq.RCVHWM) == server_mod.HWM
    assert server.sock.getsockopt(zmq.MAXMSGSIZE) == FakeEngine.max_message_bytes


def test_emptied_at_moves_only_when_the_socket_is_empty(server, monkeypatch):
    """Leases are judged at the last moment every waiting message had been handled,
    so a ping stuck behind a bounded drain cannot let its session expire."""
    monkeypatch.setattr(server_mod, "DRAIN_MAX", 3)
    monkeypatch.setattr(server_mod, "DRAIN_S", 60.0)
    sock = dealer(server.addr)
    for i in range(7):
        sock.send(b"%d" % i)
    server.sock.poll(1000, zmq.POLLIN)
    time.sleep(0.05)                                  # let all seven arrive
    full = partial = 0
    while len(server.engine.seen) < 7:
        server.sock.poll(100, zmq.POLLIN)
        before, mark = len(server.engine.seen), server.emptied_at
        server._drain()
        if len(server.engine.seen) - before == 3:     # stopped by the bound
            assert server.emptied_at == mark
            full += 1
        else:                                         # found the socket empty
            assert server.emptied_at > mark
            partial += 1
    assert full >= 1
    sock.close()


def test_emptied_at_waits_for_the_streams_messages_not_their_bytes(server, monkeypatch):
    """On the local stream too: a turn that leaves whole messages moves nothing; a
    connection that sent only part of a message (or trickles) does not hold leases."""
    import socket
    import struct

    import msgpack

    from symphony_protocol.stream import frame
    monkeypatch.setattr(server_mod, "DRAIN_MAX", 3)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.streams.path)
    server._drain()                                   # accepts it
    sock.sendall(b"".join(b"".join(frame([msgpack.packb({"op": "ping", "rid": i})]))
                          for i in range(7)) + struct.pack("<2I", 1, 100))
    time.sleep(0.05)
    marks = []
    while len(server.engine.seen) < 7:
        mark = server.emptied_at
        server._drain()
        marks.append((len(server.engine.seen), server.emptied_at > mark, server.stream_work))
    assert marks == [(3, False, True), (6, False, True), (7, True, False)]
    mark = server.emptied_at
    sock.send(b"x")                                   # more of the unfinished one
    time.sleep(0.05)
    server._drain()
    assert server.emptied_at > mark and not server.stream_work
    sock.close()
