"""The local stream's framing (symphony_protocol/stream.py): messages back out of any
split of their bytes, and every malformed or oversized header refused by name."""
from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from symphony_protocol import ProtocolError
from symphony_protocol.stream import MAX_FRAMES, Reader, Writer, frame, stream_path


def wire(parts: list) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in frame(parts))


def test_stream_path_only_beside_an_ipc_endpoint():
    assert stream_path("ipc:///run/symphony/predd.sock") == "/run/symphony/predd.sock.stream"
    assert stream_path("tcp://127.0.0.1:5555") is None
    assert stream_path("ipc://") is None


def test_messages_come_back_whole_from_any_split():
    rows = np.arange(6, dtype=np.float32)
    messages = [[b"head"], [b"h", b"", b"x" * 1000], [b"m", memoryview(rows)]]
    data = b"".join(wire(m) for m in messages)
    assert data[:12] == struct.pack("<2I", 1, 4) + b"head"
    expect = [[b"head"], [b"h", b"", b"x" * 1000], [b"m", rows.tobytes()]]
    for step in (1, 3, 7, len(data)):
        reader, got = Reader(1 << 20), []
        for at in range(0, len(data), step):
            got += reader.feed(data[at:at + step])
        assert got == expect
        assert reader.pending == 0


def test_a_frame_length_counts_bytes_not_items():
    rows = np.ones(5, dtype=np.float32)
    assert struct.unpack_from("<2I", frame([memoryview(rows)])[0]) == (1, 20)


@pytest.mark.parametrize("head,code", [
    (struct.pack("<I", 0), "EBADMSG"),
    (struct.pack("<I", MAX_FRAMES + 1), "EBADMSG"),
    (struct.pack("<2I", 1, 101), "EMSGSIZE"),      # 8 bytes of header + 101 > 100
    (struct.pack("<3I", 2, 2**31, 2**31), "EMSGSIZE"),
])
def test_bad_headers_are_refused_before_their_bodies(head, code):
    reader = Reader(100)
    with pytest.raises(ProtocolError) as exc:
        reader.feed(head)
    assert exc.value.code == code


def test_a_message_of_exactly_the_limit_is_read():
    assert Reader(8 + 92).feed(wire([b"y" * 92])) == [[b"y" * 92]]


def test_many_small_messages_in_one_read_cost_one_pass():
    data = wire([b"p"]) * 20000
    reader = Reader(100)
    got = reader.feed(data[:-3])
    assert len(got) == 19999 and got[0] == [b"p"]
    assert reader.feed(data[-3:]) == [[b"p"]] and reader.pending == 0


def drained(writer: Writer, sock, count: int, max_bytes: int) -> list[list[bytes]]:
    """Flush `writer` while reading its peer `sock` until `count` messages came."""
    reader, got = Reader(max_bytes), []
    while len(got) < count:
        writer.flush()
        try:
            got += reader.feed(sock.recv(1 << 16))
        except BlockingIOError:
            pass
    return got


def test_a_writer_keeps_order_through_partial_sends():
    import socket
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    writer = Writer(a)
    big = bytes(range(256)) * 4096                    # 1 MiB: more than the socket takes
    writer.write([b"first", big])
    assert len(writer) == 1 and 0 < writer.queued <= len(big) + 13
    queued = writer.queued
    writer.write([b"second"])                         # waits behind the first's end
    assert len(writer) == 2 and writer.queued == queued + 4 + 4 + 6
    got = drained(writer, b, 2, 1 << 21)
    assert got == [[b"first", big], [b"second"]] and len(writer) == 0 and writer.flush()
    assert writer.queued == 0
    a.close()
    b.close()


class CountingSocket:
    """A socket's `sendmsg` calls counted (socket objects take no new attributes)."""

    def __init__(self, sock) -> None:
        self.sock, self.calls = sock, []

    def sendmsg(self, buffers):
        self.calls.append(len(buffers))
        return self.sock.sendmsg(buffers)

    def send(self, data):
        return self.sock.send(data)


def test_write_all_sends_many_messages_in_order_in_few_calls():
    """2,000 two-frame messages are 6,000 buffers: six `sendmsg` calls of at most
    IOV_MAX, read back whole and in order; after a short send the rest waits, in order."""
    import socket
    from symphony_protocol.stream import IOV_MAX
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    counted = CountingSocket(a)
    writer = Writer(counted)
    messages = [[b"h%d" % i, b"x" * (i % 7)] for i in range(2000)]
    writer.write_all(messages)
    writer.write_all([])
    assert len(counted.calls) == 6 and max(counted.calls) <= IOV_MAX
    assert sum(counted.calls) == 3 * 2000
    got = drained(writer, b, 2000, 1 << 20)
    assert got == messages and writer.queued == 0 and len(writer) == 0
    a.close()
    b.close()


def test_a_writer_counts_messages_not_writes_while_they_wait():
    """Messages written together and not yet taken count one each (predd's HWM counts
    replies), until flushed."""
    import socket
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    b.setblocking(False)
    writer = Writer(a)
    big = b"x" * (1 << 20)                           # more than the socket takes
    writer.write_all([[b"one", big], [b"two"], [b"three"]])
    assert len(writer) == 3
    writer.write([b"four"])
    assert len(writer) == 4
    got = drained(writer, b, 4, 1 << 21)
    assert [m[0] for m in got] == [b"one", b"two", b"three", b"four"] and len(writer) == 0
    a.close()
    b.close()


def test_one_packer_packs_after_a_value_it_could_not():
    from symphony_protocol.codec import pack
    good = {"op": "pred", "rid": 7, "tokens": [1, 2], "raw": b"\x00"}
    with pytest.raises(TypeError):
        pack({"op": "pred", "bad": object()})
    assert pack(good) == msgpack.packb(good, use_bin_type=True)
