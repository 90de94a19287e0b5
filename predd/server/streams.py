"""predd's local stream socket: local clients' messages without ZeroMQ's I/O threads.

The listener sits beside the ipc endpoint (`symphony_protocol.stream_path`), mode 0666
like it: the kernel's SO_PEERCRED says who connected, taken once at accept and given as
the same `Peer` ("localhost:UID:GID:PID") libzmq would attach on ipc. Each connection
is one session under an identity of its own (b"\\x01" and 16 random bytes: no ZeroMQ
peer can name it in advance), so the engine,
quotas and leases see it as they see a ZeroMQ peer; when the connection closes, its
session ends at once (no lease to wait out).

All sockets are non-blocking and watched by one epoll, whose descriptor the loop polls
beside the ZeroMQ socket. Limits, as on ZeroMQ: an inbound message larger than the
engine's largest legitimate request closes its connection; at most HWM replies, and no
more once QUEUED_BYTES wait, queue for a peer that does not read them, and later ones
are dropped (logged once a connection), so a reader that stalls never blocks the loop
or grows predd without bound (1,024 unread `tokenizer` replies would be 1.5 GB). A turn hands on at most `budget` messages from all connections together, at
most MESSAGES_PER_TURN from one, in turn; a connection with whole messages left waits
in the backlog, unread, until they are handled. A uid other than predd's own holds at
most `per_uid` connections (the quota's sessions per uid), and all of them together at
most half the descriptor limit; a connection over either gets an EAGAIN error reply
and is closed as it is accepted. Out of descriptors, predd stops accepting for a
second rather than spin on a listener it cannot empty.
"""
from __future__ import annotations

import collections
import contextlib
import os
import resource
import select
import socket
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from symphony_protocol import ProtocolError, pack
from symphony_protocol.stream import Reader, Writer, frame
from predd.server.identity import Peer

RECV_BYTES = 1 << 18     # one read; a message in progress gets up to RECV_READS a turn
RECV_READS = 16
MESSAGES_PER_TURN = 64   # handled per connection per turn; the rest wait in its buffer
ACCEPT_MAX = 64          # connections accepted per turn
REFUSED_LOG_S = 1.0      # refused connections are logged at most this often
PAUSE_S = 1.0            # no accepting this long after running out of descriptors
QUEUED_BYTES = 64 << 20  # a connection's unread replies: no more queued once this many wait
_CRED = struct.Struct("3i")   # struct ucred: pid, uid, gid
IN, OUT, ERR = select.EPOLLIN, select.EPOLLOUT, select.EPOLLERR | select.EPOLLHUP


@dataclass(eq=False)
class Connection:
    sock: socket.socket
    identity: bytes
    peer: Peer
    reader: Reader
    writer: Writer
    dropped: int = 0         # replies dropped at the HWM
    held: int = 0            # bytes of the replies held while corked
    # whole messages read but not handed on: a `take` turn left them, in order
    waiting: list[list[bytes]] = field(default_factory=list)


class Streams:
    """The listener and its connections. `handle(identity, frames, peer)` gets each
    message; `ended(identity)` each connection that closed."""

    def __init__(self, path: str, max_bytes: int, hwm: int, log: Callable[[str], None],
                 per_uid: int = 0, trusted_uid: int = -1) -> None:
        self.path, self.max_bytes, self.hwm, self.log = path, max_bytes, hwm, log
        self.per_uid, self.trusted_uid = per_uid, trusted_uid
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        # half the descriptors: the rest for logits buffers, ZeroMQ, swap and the model
        self.most = max(16, (soft if soft != resource.RLIM_INFINITY else 1 << 16) // 2)
        self.of_uid: collections.Counter[int] = collections.Counter()
        # connections whose buffer may hold whole messages, in the order they are served
        self.backlog: dict[Connection, None] = {}
        self.paused_until = 0.0
        self.refused, self.refused_logged = 0, 0.0
        if os.path.lexists(path):
            os.unlink(path)   # a stale socket of a dead predd
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o666)        # peers are told apart by SO_PEERCRED
        self.listener.listen(128)
        self.listener.setblocking(False)
        self.epoll = select.epoll()
        self.scratch = bytearray(RECV_BYTES)   # every connection reads into it in turn
        self.epoll.register(self.listener.fileno(), IN)
        self.by_fd: dict[int, Connection] = {}
        self.by_identity: dict[bytes, Connection] = {}
        self._corked: dict[Connection, list[list]] | None = None   # `corked`'s held replies

    def fileno(self) -> int:
        return self.epoll.fileno()

    def owns(self, identity: bytes) -> bool:
        """Whether `identity` is one of this listener's open connections."""
        return identity in self.by_identity

    def turn(self, handle: Callable[[bytes, list[bytes], Peer], None],
             ended: Callable[[bytes], None], budget: int,
             take: Callable[[bytes, list[bytes], Peer], bool] | None = None) -> bool:
        """Accept, read and write what is ready now, and hand on at most `budget`
        messages; whether work is left (messages waiting, or bytes not yet read).
        With `take`, each message goes to it instead of `handle`; the first it does not
        take waits, with the rest of its connection's, for a turn without `take` (its
        connection is not served again until then)."""
        if self.paused_until and time.monotonic() >= self.paused_until:
            self.paused_until = 0.0
            self.epoll.register(self.listener.fileno(), IN)
        more = False
        for fd, events in self.epoll.poll(0):
            if fd == self.listener.fileno():
                self._accept()
                continue
            conn = self.by_fd.get(fd)
            if conn is None:
                continue
            if events & OUT:
                self._flush(conn, ended)
            if events & (IN | ERR) and conn.sock.fileno() != -1 and conn not in self.backlog:
                more |= self._read(conn, ended)   # (a backlog is read once handled)
        for conn in list(self.backlog):
            if budget <= 0:
                return True
            if take is not None and conn.waiting:
                continue
            budget -= self._serve(conn, min(budget, MESSAGES_PER_TURN), handle, ended, take)
        return more or bool(self.backlog)

    def _accept(self) -> None:
        for _ in range(ACCEPT_MAX):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:     # EMFILE and the like: wait for descriptors
                self.log(f"stream accept failed ({exc}); not accepting for {PAUSE_S:g}s")
                self.epoll.unregister(self.listener.fileno())
                self.paused_until = time.monotonic() + PAUSE_S
                return
            sock.setblocking(False)
            pid, uid, gid = _CRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            if len(self.by_fd) >= self.most or (
                    self.per_uid and uid != self.trusted_uid and self.of_uid[uid] >= self.per_uid):
                self._refuse(sock, uid, pid)
                continue
            self.of_uid[uid] += 1
            conn = Connection(sock, b"\x01" + os.urandom(16),
                              Peer(f"localhost:{uid}:{gid}:{pid}", uid, gid, pid),
                              Reader(self.max_bytes, self.scratch), Writer(sock))
            self.by_fd[sock.fileno()] = conn
            self.by_identity[conn.identity] = conn
            self.epoll.register(sock.fileno(), IN)

    def _refuse(self, sock: socket.socket, uid: int, pid: int) -> None:
        """An EAGAIN error reply (rid none), then the connection closed."""
        why = (f"stream connections of uid {uid}: {self.of_uid[uid]} open, at most "
               f"{self.per_uid} a uid and {self.most} in all")
        try:
            sock.sendmsg(frame([pack({"rid": None, "ok": False,
                                      "error": {"code": "EAGAIN", "message": why}})]))
        except OSError:
            pass
        sock.close()
        self.refused += 1
        now = time.monotonic()
        if now - self.refused_logged >= REFUSED_LOG_S:
            self.log(f"{self.refused} stream connection(s) refused; the last of pid {pid}: {why}")
            self.refused, self.refused_logged = 0, now

    def _read(self, conn: Connection, ended) -> bool:
        """Take what the socket holds into the connection's buffer (up to RECV_READS
        reads); whether more may be waiting. The buffer is served from the backlog."""
        for _ in range(RECV_READS):
            got = conn.reader.receive(conn.sock, RECV_BYTES)
            if got < 0:
                self._close(conn, ended)
                return False
            if got < RECV_BYTES:
                break
        else:
            self.backlog[conn] = None
            return True
        self.backlog[conn] = None
        return False

    def _serve(self, conn: Connection, most: int, handle, ended, take=None) -> int:
        """Hand on up to `most` of the connection's whole messages (those a `take` turn
        left first); how many it handed on or offered. It leaves the backlog when it has
        no whole one left, else goes to its end."""
        messages, conn.waiting = conn.waiting, []
        try:
            if len(messages) < most:
                messages += conn.reader.feed(b"", most - len(messages))
        except ProtocolError as exc:
            for message in messages if take is None else ():   # whole ones, read before
                handle(conn.identity, message, conn.peer)
            self.log(f"stream of {conn.peer.address} closed: {exc.code}: {exc}")
            self._close(conn, ended)
            return len(messages) if take is None else 0
        if len(messages) > most:
            messages, conn.waiting = messages[:most], messages[most:]
        self.backlog.pop(conn, None)
        if len(messages) == most:
            self.backlog[conn] = None
        for i, message in enumerate(messages):
            if take is None:
                handle(conn.identity, message, conn.peer)
            elif not take(conn.identity, message, conn.peer):
                conn.waiting = messages[i:] + conn.waiting
                self.backlog[conn] = None
                return i + 1           # the message offered counts against the budget
            if conn.sock.fileno() == -1:
                return i + 1
        return len(messages)

    def send(self, identity: bytes, parts: list) -> bool:
        """Queue one message for a stream identity; False when `identity` is none of
        this listener's (a ZeroMQ peer's). A closed connection's replies go nowhere."""
        conn = self.by_identity.get(identity)
        if conn is None:
            return identity[:1] == b"\x01"
        held = None if self._corked is None else self._corked.get(conn)
        if (len(conn.writer) + (len(held) if held else 0) >= self.hwm
                or conn.writer.queued + conn.held >= QUEUED_BYTES):
            if not conn.dropped:
                self.log(f"replies dropped: {conn.peer.address} reads none "
                         f"({len(conn.writer)} queued, {conn.writer.queued} bytes)")
            conn.dropped += 1
            return True
        if held is not None:
            held.append(parts)
            conn.held += sum(memoryview(part).nbytes for part in parts)
            return True
        if self._corked is not None:
            self._corked[conn] = []
        self._write(conn, [parts])
        return True

    @contextlib.contextmanager
    def corked(self) -> Iterator[None]:
        """Replies sent meanwhile (a step's, a turn's) go out a connection at a time: its
        first at once, the rest together at the end, in one `sendmsg`. A connection that
        many calls share (a threaded program's) then wakes its reader twice a step, not
        once a call; a connection with one call waits for nothing."""
        if self._corked is not None:
            yield
            return
        self._corked = {}
        try:
            yield
        finally:
            corked, self._corked = self._corked, None
            for conn, held in corked.items():
                conn.held = 0
                if held and conn.sock.fileno() != -1:
                    self._write(conn, held)

    def _write(self, conn: Connection, messages: list[list]) -> None:
        waited = len(conn.writer)
        try:
            conn.writer.write_all(messages)
            if len(conn.writer) and not waited:
                self.epoll.modify(conn.sock.fileno(), IN | OUT)
        except OSError:                # the peer went; its end is seen when read
            return

    def _flush(self, conn: Connection, ended) -> None:
        try:
            done = conn.writer.flush()
        except OSError:
            self._close(conn, ended)
            return
        if done:
            self.epoll.modify(conn.sock.fileno(), IN)

    def _close(self, conn: Connection, ended) -> None:
        fd = conn.sock.fileno()
        if fd == -1:
            return
        self.epoll.unregister(fd)
        self.backlog.pop(conn, None)
        if conn.dropped:
            self.log(f"{conn.peer.address}: {conn.dropped} replies dropped in all")
        del self.by_fd[fd]
        del self.by_identity[conn.identity]
        self.of_uid[conn.peer.uid] -= 1
        if not self.of_uid[conn.peer.uid]:
            del self.of_uid[conn.peer.uid]
        conn.sock.close()
        ended(conn.identity)

    def close(self) -> None:
        for conn in list(self.by_fd.values()):
            conn.sock.close()
        self.by_fd.clear()
        self.backlog.clear()
        self.by_identity.clear()
        self.listener.close()
        self.epoll.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
