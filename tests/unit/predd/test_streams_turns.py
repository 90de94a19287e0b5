"""predd's stream listener (predd/server/streams.py) without an engine: a turn's
messages are bounded in all and per connection and shared out in turn; a connection
with messages left keeps the loop awake; a bad header behind a backlog closes its own
connection and raises nothing; an ipc path too long for a Unix socket's name leaves the
server on ZeroMQ alone."""
from __future__ import annotations

import socket
import struct

import msgpack
import pytest

from predd.server.loop import Server
from predd.server.streams import MESSAGES_PER_TURN, Streams
from symphony_protocol.stream import Reader, frame


def ping(rid: int) -> bytes:
    return b"".join(frame([msgpack.packb({"op": "ping", "rid": rid})]))


@pytest.fixture
def streams(tmp_path):
    logs: list[str] = []
    s = Streams(str(tmp_path / "predd.sock.stream"), 1 << 20, 1024, logs.append)
    s.logs = logs
    yield s
    s.close()


def connect(streams: Streams, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(streams.path)
        socks.append(sock)
    return socks


def test_a_turn_shares_its_budget_in_turn_and_keeps_the_loop_awake(streams):
    socks = connect(streams, 8)
    for sock in socks:
        sock.sendall(b"".join(ping(rid) for rid in range(100)))
    seen: list[bytes] = []
    handle = lambda identity, frames, peer: seen.append(identity)   # noqa: E731
    ended = lambda identity: None                                   # noqa: E731
    streams.turn(handle, ended, 0)                  # accepts the eight
    served: list[list[bytes]] = []
    while streams.turn(handle, ended, 256):
        served.append(seen[:])
        seen.clear()
        assert len(served) < 10
    served.append(seen)
    counts = [len(turn) for turn in served]
    assert counts[:3] == [256, 256, 256] and sum(counts) == 800
    first_two = served[0] + served[1]               # 8 connections x 64: everyone once
    assert sorted(first_two.count(i) for i in set(first_two)) == [MESSAGES_PER_TURN] * 8
    for sock in socks:
        sock.close()


def test_a_bad_header_behind_a_backlog_closes_only_its_connection(streams):
    bad, good = connect(streams, 2)
    bad.sendall(b"".join(ping(rid) for rid in range(MESSAGES_PER_TURN)) + struct.pack("<I", 0))
    ended: list[bytes] = []
    seen: list[bytes] = []
    handle = lambda identity, frames, peer: seen.append(identity)   # noqa: E731
    streams.turn(handle, ended.append, 256)         # accepts
    while streams.turn(handle, ended.append, 256):
        pass
    assert len(seen) == MESSAGES_PER_TURN and len(ended) == 1
    assert any("EBADMSG" in line for line in streams.logs)
    bad.settimeout(5)
    assert bad.recv(1) == b""
    good.sendall(ping(1))
    streams.turn(handle, ended.append, 256)
    assert len(seen) == MESSAGES_PER_TURN + 1 and len(ended) == 1
    good.close()


class NoEngine:
    max_message_bytes = 1 << 20

    def release_held(self) -> None:
        pass


def test_an_ipc_path_too_long_for_a_socket_name_leaves_zmq_alone(tmp_path):
    deep = tmp_path / ("d" * (104 - len(str(tmp_path)) - len("//predd.sock")))
    deep.mkdir()
    addr = f"ipc://{deep}/predd.sock"
    # ZeroMQ binds 104 bytes; 111 (with .stream) exceed a Unix socket name's 107
    assert len(addr) - len("ipc://") == 104
    logs: list[str] = []
    server = Server(addr, lambda send, log: NoEngine(), log=logs.append)
    try:
        assert server.streams is None
        assert any(line.startswith("no local stream") for line in logs)
    finally:
        server.close()


def test_replies_to_a_peer_that_reads_none_stop_queueing_at_their_bytes(streams, monkeypatch):
    """Big replies (a `tokenizer`'s 1.5 MB) to a connection that never reads: what the
    socket does not take queues up to QUEUED_BYTES, then each further reply is dropped
    and counted; the log says so once."""
    import predd.server.streams as module
    monkeypatch.setattr(module, "QUEUED_BYTES", 4 << 20)
    [sock] = connect(streams, 1)
    identity = []
    streams.turn(lambda *a: None, lambda i: None, 0)             # accepts it
    sock.sendall(ping(1))
    streams.turn(lambda ident, frames, peer: identity.append(ident), lambda i: None, 8)
    big = b"x" * (1 << 20)
    for _ in range(12):
        assert streams.send(identity[0], [b"header", big])
    conn = streams.by_identity[identity[0]]
    assert 4 << 20 <= conn.writer.queued < (4 << 20) + (1 << 20) + 64
    assert conn.dropped >= 1 and len(conn.writer) + conn.dropped < 12 + 1
    assert [m for m in streams.logs if "replies dropped" in m and "bytes" in m]
    sock.close()


def test_corked_replies_go_out_a_connection_at_a_time(streams):
    """While corked (a step, a turn) a connection's first reply goes at once and the rest
    wait for the end, then come in order in one write; a connection with one reply
    waits for nothing; a reply over the HWM counts the held ones and is dropped."""
    a, b = connect(streams, 2)
    ids: list[bytes] = []
    streams.turn(lambda *x: None, lambda i: None, 0)             # accepts both
    for sock in (a, b):
        sock.sendall(ping(1))
        streams.turn(lambda ident, frames, peer: ids.append(ident), lambda i: None, 8)
    a.setblocking(False)
    b.setblocking(False)
    reader_a, reader_b = Reader(1 << 20), Reader(1 << 20)
    streams.hwm = 3
    with streams.corked():
        for n in range(5):
            assert streams.send(ids[0], [b"a%d" % n])
        assert streams.send(ids[1], [b"b0"])
        assert reader_a.feed(a.recv(1 << 16)) == [[b"a0"]]       # the first, at once
        assert reader_b.feed(b.recv(1 << 16)) == [[b"b0"]]
        with pytest.raises(BlockingIOError):
            a.recv(1 << 16)                                      # the rest are held
        with streams.corked():                                   # nested: one cork
            assert streams.send(ids[1], [b"b1"])
        with pytest.raises(BlockingIOError):
            b.recv(1 << 16)
    assert reader_a.feed(a.recv(1 << 16)) == [[b"a1"], [b"a2"], [b"a3"]]
    assert reader_b.feed(b.recv(1 << 16)) == [[b"b1"]]
    assert streams.by_identity[ids[0]].dropped == 1             # a4: three held, the HWM
    assert [m for m in streams.logs if "replies dropped" in m]
    a.close()
    b.close()


def test_a_take_turn_leaves_a_refused_message_and_the_rest_of_its_connection_in_order(streams):
    """`take` turns (a step's pass in flight): what `take` refuses waits, with every later
    message of its connection, for a turn without `take`, which hands them on first and
    in order; other connections go on being served meanwhile."""
    x, y = connect(streams, 2)
    x.sendall(ping(1) + ping(2) + ping(3))
    y.sendall(ping(4) + ping(5))
    taken: list[int] = []
    offered: list[int] = []

    def take(identity, frames, peer) -> bool:
        rid = msgpack.unpackb(frames[0])["rid"]
        offered.append(rid)
        if rid == 2:
            return False
        taken.append(rid)
        return True

    handled: list[int] = []

    def handle(identity, frames, peer) -> None:
        handled.append(msgpack.unpackb(frames[0])["rid"])
    ended = lambda identity: None                                   # noqa: E731
    streams.turn(handle, ended, 0)                  # accepts the two
    for _ in range(3):
        assert streams.turn(handle, ended, 256, take=take)   # x's wait: work left
    assert sorted(taken) == [1, 4, 5] and offered.count(2) == 1 and handled == []
    y.sendall(ping(6))
    streams.turn(handle, ended, 256, take=take)
    assert taken[-1] == 6 and handled == []
    streams.turn(handle, ended, 256)
    assert handled == [2, 3]
    x.sendall(ping(7))
    streams.turn(handle, ended, 256, take=take)
    assert taken[-1] == 7
    x.close()
    y.close()


def test_a_message_a_take_turn_offers_counts_against_its_budget(streams):
    socks = connect(streams, 3)
    for i, sock in enumerate(socks):
        sock.sendall(ping(i))
    offered: list[int] = []

    def refuse(identity, frames, peer) -> bool:
        offered.append(msgpack.unpackb(frames[0])["rid"])
        return False
    ended = lambda identity: None                                   # noqa: E731
    streams.turn(refuse, ended, 0)                  # accepts the three
    streams.turn(refuse, ended, 2, take=refuse)
    assert len(offered) == 2
    streams.turn(refuse, ended, 2, take=refuse)
    assert sorted(offered) == [0, 1, 2]             # the third, then nothing again
    for sock in socks:
        sock.close()
