"""A thread-safe predd client: many threads, one connection, one session.

One I/O thread owns the ZeroMQ DEALER socket. Callers hand it requests through an
inproc PUSH socket (guarded by a lock) and wait on a per-request queue that the I/O
thread fills with the replies (several for a stream). The I/O thread also keeps the
session's lease alive, and fails every waiting call with EIO when predd is unreachable
(not connected for `dead_after_s`) or hung (connected but silent for `silent_after_s`)
— a LIP never hangs on a dead predd, and a busy one is not mistaken for dead.

Identity: on ipc predd learns the uid from the kernel; `hello` declares os.getuid() only
as a check (predd answers EPERM on a mismatch). On tcp the uid comes from a token
(`token=` or $SYMPHONY_TOKEN) when predd has --auth-keys, else the session is nobody.
"""
from __future__ import annotations

import collections
import itertools
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from liblip.protocol import (ProtocolError, Reply, decode_reply, default_addr,
                             default_token, encode_request)


class LipError(ProtocolError):
    """An error from predd, kvfsd or liblip itself; `.code` is the errno name."""


def _uid_is_the_kernels() -> bool:
    """Whether os.getuid() is the uid predd sees: not inside a user namespace that
    maps uids (there SO_PEERCRED reports the outer uid, and a declared one would not
    match). Unreadable /proc: assume no mapping."""
    try:
        with open("/proc/self/uid_map") as f:
            lines = f.read().split()
    except OSError:
        return True
    return lines in ([], ["0", "0", "4294967295"])


_STOP = object()


class Client:
    def __init__(self, addr: str | None = None, lease_s: float = 10.0,
                 name: str | None = None, dead_after_s: float = 3.0,
                 silent_after_s: float = 120.0, token: str | None = None) -> None:
        self.addr = addr or default_addr()
        self.lease_s = lease_s
        self.dead_after_s = dead_after_s
        self.silent_after_s = silent_after_s
        self._ctx = zmq.Context()
        self._inbox = f"inproc://liblip-{id(self)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._inbox)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(self._inbox)
        self._push_lock = threading.Lock()
        self._rids = itertools.count(1)
        self._waiting: dict[int, queue.Queue] = {}
        self._waiting_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._io, name="liblip-io", daemon=True)
        self._thread.start()
        hello = {"pid": os.getpid(), "lease_s": lease_s,
                 "client": name or os.path.basename(sys.argv[0] or "lip")}
        if self.addr.startswith("ipc://") and _uid_is_the_kernels():
            hello["uid"] = os.getuid()
        token = default_token() if token is None else token
        if token:
            hello["token"] = token
        try:
            self.session = self.call("hello", **hello)
        except BaseException:
            self._shutdown()   # no I/O thread or context left behind
            raise

    # ------------------------------------------------------------ calling

    def _send(self, op: str, fields: dict, frames: tuple[bytes, ...]) -> tuple[int, queue.Queue]:
        if self._closed:
            raise LipError("EBADF", "client is closed")
        rid = next(self._rids)
        inbox: queue.Queue = queue.Queue()
        with self._waiting_lock:
            self._waiting[rid] = inbox
        with self._push_lock:
            self._push.send_multipart([encode_request(op, rid, fields), *frames], copy=False)
        return rid, inbox

    def _get(self, rid: int, inbox: queue.Queue, timeout: float | None) -> tuple[dict, list]:
        try:
            item = inbox.get(timeout=timeout)
        except queue.Empty:
            self._forget(rid)
            raise LipError("ETIMEDOUT", f"no reply from predd at {self.addr} "
                           f"in {timeout:.1f}s") from None
        if isinstance(item, LipError):
            raise item
        header, frames = item
        if not header.get("ok"):
            err = header.get("error") or {}
            self._forget(rid)
            raise LipError(err.get("code", "EIO"), err.get("message", "unknown error"))
        return header, frames

    def _forget(self, rid: int) -> None:
        with self._waiting_lock:
            self._waiting.pop(rid, None)

    def request(self, op: str, frames: tuple[bytes, ...] = (), timeout: float | None = None,
                **fields) -> tuple[dict, list]:
        """One request, its reply header and binary frames. Raises LipError."""
        rid, inbox = self._send(op, fields, frames)
        try:
            return self._get(rid, inbox, timeout)
        finally:
            self._forget(rid)

    def call(self, op: str, timeout: float | None = None, **fields) -> dict:
        return self.request(op, timeout=timeout, **fields)[0]

    def stream(self, op: str, timeout: float | None = None, **fields) -> Iterator[dict]:
        """Replies of a streaming op, up to and including the one without `more`."""
        rid, inbox = self._send(op, fields, ())
        try:
            while True:
                header, _ = self._get(rid, inbox, timeout)
                yield header
                if not header.get("more"):
                    return
        finally:
            self._forget(rid)

    def ask(self, op: str, frames: tuple[bytes, ...] = (), timeout: float | None = None,
            **fields) -> Reply:
        """One request's reply as its record (liblip.protocol.REPLIES: a KvReply for
        kv_stat, a PredLogits for a raw pred, ...). Raises LipError."""
        header, extra = self.request(op, frames, timeout, **fields)
        return decode_reply(op, header, extra)

    def ask_stream(self, op: str, timeout: float | None = None, **fields) -> Iterator[Reply]:
        """`stream`, as records: GenerateChunks, then the one GenerateReply."""
        for header in self.stream(op, timeout, **fields):
            yield decode_reply(op, header)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.call("bye", timeout=2.0)
        except LipError:
            pass
        self._shutdown()

    def _shutdown(self) -> None:
        self._closed = True
        with self._push_lock:
            self._push.send_multipart([b""])   # wakes the I/O thread to stop
        self._thread.join(timeout=5)
        self._push.close(0)
        self._ctx.term()

    # ------------------------------------------------------------ I/O thread

    def _io(self) -> None:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        # Queue only to a live predd: a request must never reach a later predd at the
        # same address after its caller was told EIO (it could create an orphan there).
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        outbox: collections.deque[list] = collections.deque()
        monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        dealer.connect(self.addr)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        ping_every = min(self.lease_s / 3, 1.0)
        last_heard = last_sent = down_since = time.monotonic()
        connected = False
        ping_rid = -1
        while True:
            events = dict(poller.poll(20 if outbox else ping_every * 1e3 / 2))
            now = time.monotonic()
            if self._pull in events:
                while True:
                    try:
                        frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    if frames == [b""]:
                        dealer.disable_monitor()
                        monitor.close(0)
                        dealer.close(0)
                        self._pull.close(0)
                        return
                    outbox.append(frames)
            while outbox:
                try:
                    dealer.send_multipart(outbox[0], zmq.NOBLOCK, copy=False)
                except zmq.Again:   # not connected (yet): retry, or fail below
                    break
                outbox.popleft()
                last_sent = now
            if dealer in events:
                while True:
                    try:
                        frames = dealer.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    last_heard = now
                    self._deliver(frames)
            if monitor in events:
                while True:
                    try:
                        event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                    except zmq.Again:
                        break
                    connected = event == zmq.EVENT_CONNECTED
                    last_heard = down_since = now
            if now - last_sent >= ping_every:
                try:
                    dealer.send_multipart([encode_request("ping", ping_rid, {})], zmq.NOBLOCK)
                except zmq.Again:
                    pass
                last_sent = now
            if not self._waiting:
                continue
            if not connected and now - down_since > self.dead_after_s:
                outbox.clear()
                self._fail_all(LipError("EIO", f"predd at {self.addr} is unreachable"))
            elif connected and now - last_heard > self.silent_after_s:
                self._fail_all(LipError("EIO", f"predd at {self.addr} is not answering "
                                        f"({now - last_heard:.0f}s of silence)"))
                last_heard = now

    def _deliver(self, frames: list[bytes]) -> None:
        try:
            header = msgpack.unpackb(frames[0], raw=False)
            rid = header.get("rid")
        except Exception:
            return
        with self._waiting_lock:
            inbox = self._waiting.get(rid)
        if inbox is not None:
            inbox.put((header, frames[1:]))

    def _fail_all(self, error: LipError) -> None:
        with self._waiting_lock:
            inboxes = list(self._waiting.values())
            self._waiting.clear()
        for inbox in inboxes:
            inbox.put(error)
