"""A bare DEALER socket speaking predd's wire protocol: frames liblip would never send,
and requests left in flight while another peer talks."""
from __future__ import annotations

import msgpack
import zmq


class Peer:
    """A bare DEALER socket: frames liblip would never send, and requests left in
    flight while another peer talks."""

    def __init__(self, addr: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 60000)
        self.sock.connect(addr)
        self.rid = 0
        self.ok("hello", client="test", lease_s=120.0)   # it does not ping as liblip does

    def send(self, op: str, *frames: bytes, **fields) -> int:
        self.rid += 1
        self.sock.send_multipart([msgpack.packb({"op": op, "rid": self.rid, **fields},
                                                use_bin_type=True), *frames])
        return self.rid

    def recv(self) -> tuple[dict, list[bytes]]:
        head, *frames = self.sock.recv_multipart()
        return msgpack.unpackb(head), frames

    def ask(self, op: str, *frames: bytes, **fields) -> dict:
        rid = self.send(op, *frames, **fields)
        head, _ = self.recv()
        assert head["rid"] == rid
        return head

    def ok(self, op: str, *frames: bytes, **fields) -> dict:
        head = self.ask(op, *frames, **fields)
        assert head["ok"], head
        return head

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
