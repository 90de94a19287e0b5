"""The local stream: predd's messages over a plain Unix stream socket.

Beside an ipc endpoint `ipc://DIR/predd.sock` predd also listens on the Unix stream
socket `DIR/predd.sock.stream` (`stream_path`). A local client that reaches it sends and
receives the same messages as on ZeroMQ — a msgpack map, then binary frames — with no
I/O thread on either side: a call is one `sendmsg` and one `recv` per end, where ZeroMQ
hands each message to and from an I/O thread in both processes. The kernel vouches for
the peer (SO_PEERCRED) as it does on ipc. ZeroMQ stays for remote clients, for clients
that cannot reach the stream socket, and for other languages.

A message on the stream is

    u32 n   u32 len[0] ... u32 len[n-1]   frame 0 ... frame n-1

all integers little-endian; `len` counts the bytes of its frame. A connection is one
session: it opens with the connection's first message and ends when either side closes.
"""
from __future__ import annotations

import collections
import socket
import struct

from symphony_protocol.requests import ProtocolError

STREAM_SUFFIX = ".stream"
MAX_FRAMES = 64          # frames in one message (a kv_import has two)
IOV_MAX = 1024           # buffers one sendmsg takes (Linux's UIO_MAXIOV)
# n little-endian u32s, n up to a header's: its count and MAX_FRAMES sizes
_U32S = [struct.Struct(f"<{n}I") for n in range(MAX_FRAMES + 2)]


def stream_path(addr: str) -> str | None:
    """The local stream socket beside an ipc endpoint; None for other transports."""
    if not addr.startswith("ipc://") or len(addr) <= len("ipc://"):
        return None
    return addr[len("ipc://"):] + STREAM_SUFFIX


def frame(parts: list) -> list:
    """`parts` (bytes-like) as the buffers of one message, for `socket.sendmsg`."""
    return _framed(parts)[0]


def _framed(parts: list) -> tuple[list, int]:
    """`frame(parts)`, and its bytes in all."""
    sizes = [memoryview(part).nbytes for part in parts]
    head = _U32S[len(parts) + 1].pack(len(parts), *sizes)
    return [head, *parts], len(head) + sum(sizes)


class Reader:
    """Messages out of a stream's bytes, as they arrive: `feed` takes what `recv` gave
    and returns the messages it completed (at most `limit` of them; the rest wait for
    the next call), each a list of frames (bytes). A message
    longer than `max_bytes`, or with no frames or more than MAX_FRAMES, raises
    ProtocolError (EMSGSIZE, EBADMSG): the connection cannot be read any further."""

    def __init__(self, max_bytes: int, scratch: bytearray | None = None) -> None:
        self.max_bytes = max_bytes
        self._buf = bytearray()
        self._lens: tuple[int, ...] | None = None   # the message being read
        self._head = self._body = 0                 # its header's bytes, its frames'
        # what `recv_into` reads into: given (one for every reader of a thread) or made
        # at the first read. (`recv(size)` makes a bytes object of `size` each call: at
        # 256 KiB that is an mmap and munmap a read, docs/kernels.md, "One buffer for
        # every read".)
        self._scratch = scratch

    @property
    def pending(self) -> int:
        return len(self._buf)

    def receive(self, sock: socket.socket, size: int) -> int:
        """One `recv` of up to `size` bytes from a non-blocking socket into the buffer:
        how many came (0: none waiting), -1 when the peer closed or the socket failed."""
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = bytearray(size)
        try:
            got = sock.recv_into(scratch, min(size, len(scratch)))
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError:
            return -1
        if not got:
            return -1
        with memoryview(scratch) as view:
            self._buf += view[:got]
        return got

    def feed(self, data: bytes, limit: int = 1 << 62) -> list[list[bytes]]:
        buf = self._buf
        if data:
            buf += data
        out: list[list[bytes]] = []
        pos = 0                 # consumed bytes: dropped once, at the end (not per message)
        size = len(buf)
        while len(out) < limit:
            if self._lens is None:
                if size - pos < 4:
                    break
                n = _U32S[1].unpack_from(buf, pos)[0]
                if not 0 < n <= MAX_FRAMES:
                    raise ProtocolError("EBADMSG", f"stream message of {n} frames")
                head = 4 + 4 * n
                if size - pos < head:
                    break
                lens = _U32S[n].unpack_from(buf, pos + 4)
                body = sum(lens)
                if head + body > self.max_bytes:
                    raise ProtocolError("EMSGSIZE", f"stream message of {head + body} "
                                        f"bytes (at most {self.max_bytes})")
                self._lens, self._head, self._body = lens, head, body
            at = pos + self._head
            if size < at + self._body:
                break
            message = []
            for length in self._lens:
                message.append(bytes(buf[at:at + length]))
                at += length
            pos = at
            self._lens = None
            out.append(message)
        if pos:
            del buf[:pos]
        return out


class Writer:
    """Messages onto a non-blocking stream socket, in order: one is sent at once when
    nothing waits before it; what the socket does not take waits (`len`: how many
    messages, a message partly sent counted; `queued`: their bytes) until `flush`. An
    OSError other than EAGAIN (the peer gone) reaches the caller."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._waiting: collections.deque[list] = collections.deque()   # [bytes, messages]
        self._messages = 0
        self.queued = 0

    def __len__(self) -> int:
        return self._messages

    def write(self, parts: list) -> None:
        self._write(*_framed(parts), 1)

    def write_all(self, messages: list[list]) -> None:
        """Messages (each `parts`, as `write` takes) in order: one `sendmsg` for as many
        as IOV_MAX buffers hold."""
        buffers: list = []
        total = count = 0
        for parts in messages:
            framed, size = _framed(parts)
            if len(buffers) + len(framed) > IOV_MAX:
                self._write(buffers, total, count)
                buffers, total, count = [], 0, 0
            buffers += framed
            total += size
            count += 1
        if buffers:
            self._write(buffers, total, count)

    def _write(self, buffers: list, total: int, count: int) -> None:
        sent = 0
        if not self._waiting:
            try:
                sent = self.sock.sendmsg(buffers)
            except (BlockingIOError, InterruptedError):
                pass
            if sent == total:
                return
        self._waiting.append([memoryview(b"".join(buffers))[sent:], count])
        self._messages += count
        self.queued += total - sent

    def flush(self) -> bool:
        """Send what waits, as far as the socket takes it; whether all of it went."""
        while self._waiting:
            entry = self._waiting[0]
            try:
                sent = self.sock.send(entry[0])
            except (BlockingIOError, InterruptedError):
                return False
            self.queued -= sent
            if sent < len(entry[0]):
                entry[0] = entry[0][sent:]
                return False
            self._waiting.popleft()
            self._messages -= entry[1]
        return True
