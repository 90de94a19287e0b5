"""A thread-safe predd client: many threads, one connection, one session.

One ZeroMQ DEALER socket, used by whichever thread holds its lock. A call that is the
only one waiting reads the socket itself: a program calling pred() in a loop from one
thread sends and receives on that thread, with no hand-off to another (on the local
stream the short way, `_alone`, until anything else happens). While several
calls wait, the keeper thread reads for all of them and puts each reply in the queue of
the request it answers; when one waiter is left, it hands the socket to it. A request is
sent by its own thread when the socket is free, else handed to the reader through a
queue and an eventfd that the reader polls too. A stream taken with `stream_into` is
not handed over at all: the reader gives each of its replies to the caller's callback
where it reads them, and wakes the caller once, at its end. (One thread's round trip is
shorter and takes less CPU this way than through an I/O thread, and many threads' the same;
measured: docs/kernels.md, "liblip's client reads on the calling thread".)

The keeper thread also keeps the session's lease alive (ping) and watches the
connection when no one reads; whoever holds the socket fails every waiting call with
EIO when predd is unreachable (not connected for `dead_after_s`) or hung (connected but
silent for `silent_after_s`) — a LIP never hangs on a dead predd, and a busy one is not
mistaken for dead.

Transport: on ipc the client first tries predd's local stream socket
(symphony_protocol/stream.py): one `sendmsg` and one `recv` a call, no ZeroMQ I/O
thread on either side. Where it cannot be reached (an older predd, a sandbox that does
not see it, $LIBLIP_TRANSPORT=zmq) the DEALER socket carries everything, as it does
on tcp. A stream that closes fails the calls waiting on it with EIO at once (their
session is gone with it), or with the errno predd refused it with (EAGAIN); the next
call connects again, its `hello` first. A request whose caller was answered (with an
error) before it could be sent is dropped, never sent late.

Identity: on ipc predd learns the uid from the kernel; `hello` declares os.getuid() only
as a check (predd answers EPERM on a mismatch). On tcp the uid comes from a token
(`token=` or $SYMPHONY_TOKEN) when predd has --auth-keys, else the session is nobody.
"""
from __future__ import annotations

import collections
import itertools
import os
import queue
import select
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import msgpack
import zmq
from zmq.utils.monitor import recv_monitor_message

from liblip.logits_buffer import MOST_SLOTS, SLOTS, LogitsBuffer
from symphony_protocol import (ProtocolError, Reply, decode_reply, default_addr,
                             default_token, encode_request)
from symphony_protocol.stream import Reader, Writer, stream_path


class LipError(ProtocolError):
    """An error from predd, kvfsd or liblip itself; `.code` is the errno name,
    `.from_predd` whether predd replied with it (else no reply came)."""
    from_predd: bool = False


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


T = TypeVar("T")
# put in a waiting call's queue: the socket is free, read it yourself
_READ = object()
FOLLOW_S = 0.05     # a call that does not hold the socket looks again this often
KEEP_S = 0.1        # the keeper thread's round
RETRY_S = 0.02      # a reader retries sending this often while not connected
CANCEL_TIMEOUT_S = 5.0   # a stream left early waits this long for its call to end
_LEAVE = object()    # put in a delivered stream's end queue: on_reply asked to leave


def _refusal(header: dict) -> LipError:
    """The LipError of predd's error reply `header`."""
    err = header.get("error") or {}
    exc = LipError(err.get("code", "EIO"), err.get("message", "unknown error"))
    exc.from_predd = True
    return exc


class _Delivered:
    """A streaming call's queue whose replies are handled where they are read
    (`Client.stream_into`): every reply but the last goes to `on_reply` on the reading
    thread; the last, an error, or the request to leave goes to `ended` for the caller.
    No caller reads for it, so a `_READ` hand-off wakes the keeper instead."""

    def __init__(self, client: "Client", on_reply: Callable[[dict], Any]) -> None:
        self.client, self.on_reply = client, on_reply
        self.ended: queue.SimpleQueue = queue.SimpleQueue()
        self.leaving = False
        self.error: BaseException | None = None
        self.heard = time.monotonic()

    def empty(self) -> bool:
        return True

    def put(self, item) -> None:
        if item is _READ:
            self.client._wanted.set()
            return
        self.heard = time.monotonic()
        if isinstance(item, LipError) or not item[0].get("ok") or not item[0].get("more"):
            self.ended.put(item)
            return
        if self.leaving:
            return
        self.client._delivering_on = threading.get_ident()
        try:
            keep = self.on_reply(item[0])
        except Exception as exc:   # noqa: BLE001 - the caller's, raised in its thread
            self.error, keep = exc, False
        finally:
            self.client._delivering_on = None
        if keep is False:
            self.leaving = True
            self.ended.put(_LEAVE)
# zmq's flags as plain ints: its enum.Flag values cost a Python call at every | and &
NOBLOCK, EVENTS = int(zmq.NOBLOCK), int(zmq.EVENTS)
POLLIN = int(zmq.POLLIN)
RECV_BYTES = 1 << 18           # read at most this much from the stream per round
MAX_REPLY_BYTES = 1 << 40      # replies are predd's: no limit but the stream's sanity


class Client:
    def __init__(self, addr: str | None = None, lease_s: float = 10.0,
                 name: str | None = None, dead_after_s: float = 3.0,
                 silent_after_s: float = 120.0, token: str | None = None) -> None:
        self.addr = addr or default_addr()
        self.lease_s = lease_s
        self.dead_after_s = dead_after_s
        self.silent_after_s = silent_after_s
        self._ctx = zmq.Context()
        self._sock_lock = threading.Lock()     # whoever holds it may use the sockets below
        self._dealer = self._ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        # Queue only to a live predd: a request must never reach a later predd at the
        # same address after its caller was told EIO (it could create an orphan there).
        self._dealer.setsockopt(zmq.IMMEDIATE, 1)
        self._monitor = self._dealer.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        # the local stream, when predd has one: everything goes through it
        self._stream_path = (None if os.environ.get("LIBLIP_TRANSPORT") == "zmq"
                             else stream_path(self.addr))
        self._stream: socket.socket | None = None
        self._stream_reader: Reader | None = None
        self._stream_writer: Writer | None = None
        self._stream_error: LipError | None = None   # why predd refused the stream
        # requests handed to the reader by callers that found the socket busy, and the
        # eventfd that wakes its poll for them
        self._handed: collections.deque[tuple[int, list]] = collections.deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # closed with the client object, never before: a late hand-off racing close()
        # must not write into a descriptor number reused meanwhile
        weakref.finalize(self, os.close, self._wake)
        # On the stream the reader waits on two descriptors with poll(2); through
        # ZeroMQ on its sockets too (zmq_poll costs a few syscalls more a wait).
        self._poller: Any = select.poll()          # or a zmq.Poller (below)
        self._poller.register(self._wake, select.POLLIN)
        if self._stream_path is None or not self._open_stream(first=True):
            self._stream_path = None
            self._poller = zmq.Poller()
            for sock in (self._dealer, self._monitor, self._wake):
                self._poller.register(sock, POLLIN)
            self._dealer.connect(self.addr)
        # (rid, message) not sent yet; -1: no caller waits (ping, a reconnection's hello)
        self._outbox: collections.deque[tuple[int, list]] = collections.deque()
        self._ping_every = min(lease_s / 3, 1.0)
        self._last_heard = self._last_sent = self._down_since = time.monotonic()
        self._connected = self._stream is not None
        self._rids = itertools.count(1)
        self._waiting: dict[int, queue.SimpleQueue] = {}
        self._waiting_lock = threading.Lock()
        self._delivering = 0                   # stream_into calls waiting: the keeper reads
        self._delivering_on: int | None = None  # the thread inside an on_reply, if any
        self._closed = False
        self._stop = threading.Event()
        self._wanted = threading.Event()       # wakes the keeper to read for several calls
        self._thread = threading.Thread(target=self._keep, name="liblip-keeper", daemon=True)
        self._thread.start()
        hello = {"pid": os.getpid(), "lease_s": lease_s,
                 "client": name or os.path.basename(sys.argv[0] or "lip")}
        if self.addr.startswith("ipc://") and _uid_is_the_kernels():
            hello["uid"] = os.getuid()
        token = default_token() if token is None else token
        if token:
            hello["token"] = token
        self._hello = hello
        # raw pred rows through shared memory (liblip/logits_buffer.py), set up by the
        # first raw pred that asks (`logits_buffer`)
        self.logits: LogitsBuffer | None = None
        self.logits_refused = ""
        self._logits_asked = False
        self._logits_lock = threading.Lock()
        try:
            self.session = self.call("hello", **hello)
        except BaseException:
            self._shutdown()   # no I/O thread or context left behind
            raise

    # ------------------------------------------------------------ calling

    def _send(self, op: str, fields: dict, frames: tuple[bytes, ...],
              inbox: Any = None) -> tuple[int, queue.SimpleQueue]:
        if self._closed:
            raise LipError("EBADF", "client is closed")
        if self._delivering_on == threading.get_ident():
            raise LipError("EDEADLK", f"{op}: a call from inside a stream_into callback "
                           "would wait for the thread that reads its reply")
        rid = next(self._rids)
        message = [encode_request(op, rid, fields), *frames]   # (before it waits: may raise)
        if inbox is None:
            inbox = queue.SimpleQueue()
        with self._waiting_lock:
            self._waiting[rid] = inbox
        if self._sock_lock.acquire(blocking=False):
            try:
                self._outbox.append((rid, message))
                self._flush(time.monotonic())
            finally:
                self._sock_lock.release()
        else:                                   # the reader sends it
            self._handed.append((rid, message))
            os.eventfd_write(self._wake, 1)
        return rid, inbox

    def _get(self, rid: int, inbox: queue.SimpleQueue, timeout: float | None) -> tuple[dict, list]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if inbox.empty():           # (only this call takes from its inbox)
                if self._closed:        # raced close(): nothing will answer it
                    self._forget(rid)
                    raise LipError("EBADF", "client is closed")
                if left is not None and left <= 0:
                    self._forget(rid)
                    raise LipError("ETIMEDOUT", f"no reply from predd at {self.addr} "
                                   f"in {timeout:.1f}s") from None
                if len(self._waiting) == 1 and self._sock_lock.acquire(blocking=False):
                    try:                    # the only call waiting: read for itself
                        self._read_until(inbox, left)
                    finally:
                        self._release(rid)
                    continue
                self._wanted.set()          # several wait, or the socket is busy
                try:
                    item = inbox.get(timeout=FOLLOW_S if left is None else min(left, FOLLOW_S))
                except queue.Empty:
                    continue
            else:
                item = inbox.get_nowait()
            if item is not _READ:
                break
        if isinstance(item, LipError):
            raise item
        header, frames = item
        if not header.get("ok"):
            self._forget(rid)
            raise _refusal(header)
        return header, frames

    def _forget(self, rid: int) -> None:
        with self._waiting_lock:
            self._waiting.pop(rid, None)

    def request(self, op: str, frames: tuple[bytes, ...] = (), timeout: float | None = None,
                **fields) -> tuple[dict, list]:
        """One request, its reply header and binary frames. Raises LipError."""
        if (self._stream is not None and not self._waiting and not self._delivering
                and not frames and timeout is None and not self._closed
                and self._sock_lock.acquire(blocking=False)):
            rid, inbox, got = self._alone(op, fields)     # releases the socket
        else:
            rid, inbox = self._send(op, fields, frames)
            got = None
        try:
            if got is None:
                got = self._get(rid, inbox, timeout)
            elif not got[0].get("ok"):
                raise _refusal(got[0])
            return got
        finally:
            self._forget(rid)

    def _alone(self, op: str, fields: dict) -> tuple[int, queue.SimpleQueue, tuple | None]:
        """The call of a thread that holds the socket with no other call waiting, on the
        local stream: its request written and its reply read here, with none of the
        general path's hand-offs (`_send`, `_get`, `_pump`): its rid, its inbox and the
        reply (header, frames). Anything else — the reply not here within half a ping
        interval, another thread's request (the eventfd), a write the socket did not
        take, the stream closed — gives the socket up and returns no reply: the
        general path (`_get`, with the inbox) goes on from there. The caller holds the
        socket lock; it is released here, and the rid forgotten if this raises."""
        try:
            rid = next(self._rids)
            message = [encode_request(op, rid, fields)]
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            with self._waiting_lock:
                self._waiting[rid] = inbox
        except BaseException:
            self._sock_lock.release()
            raise
        got = None
        try:
            now = time.monotonic()
            if (self._stream is None or self._outbox or self._handed
                    or len(self._stream_writer) or not self._stream_write(message)):
                self._outbox.append((rid, message))   # behind what waits: `_pump` sends it
                return rid, inbox, None
            self._last_sent = now
            stream, reader = self._stream, self._stream_reader
            fd, deadline = stream.fileno(), now + self._ping_every / 2   # then pings are due
            while got is None and not len(self._stream_writer):
                left = deadline - time.monotonic()
                # the eventfd, or POLLHUP: the general path. (A hand-off that a `_pump`
                # took before its sender wrote the eventfd leaves a count that sends the
                # next call alone there once: a cost, never a loss.)
                events = self._poller.poll(left * 1e3) if left > 0 else ()
                if len(events) != 1 or events[0] != (fd, select.POLLIN):
                    break
                if reader.receive(stream, RECV_BYTES) <= 0:
                    break                     # closed (seen again by `_pump`), or nothing
                self._last_heard = time.monotonic()
                try:
                    messages = reader.feed(b"")
                except ProtocolError:         # not predd's framing: nothing more can be read
                    self._close_stream(self._last_heard)
                    break
                for frames in messages:
                    header = _header(frames)
                    if got is None and header is not None and header.get("rid") == rid:
                        got = header, frames[1:]      # the first, as `_get` takes it
                    else:
                        self._deliver(frames)
            return rid, inbox, got
        except BaseException:
            self._forget(rid)
            raise
        finally:
            self._release(rid)

    def call(self, op: str, timeout: float | None = None, **fields) -> dict:
        return self.request(op, timeout=timeout, **fields)[0]

    def stream(self, op: str, timeout: float | None = None, **fields) -> Iterator[dict]:
        """Replies of a streaming op, up to and including the one without `more`. Left
        before its end (the iterator closed, or no reply in `timeout`), the call is
        cancelled in predd (`cancel`: a generate stops after its current step) and its
        end awaited, so the cache is settled when the caller goes on."""
        rid, inbox = self._send(op, fields, ())
        ended = False
        try:
            while True:
                try:
                    header, _ = self._get(rid, inbox, timeout)
                except LipError as exc:
                    ended = exc.code != "ETIMEDOUT"   # an error reply is the terminal one
                    raise
                ended = not header.get("more")
                yield header
                if ended:
                    return
        finally:
            if not ended:
                self._cancel(rid)
            self._forget(rid)

    def stream_into(self, op: str, on_reply: Callable[[dict], Any],
                    timeout: float | None = None, **fields) -> dict:
        """A streaming op whose replies are handled where they are read: each one
        before the last goes to `on_reply(header)` on the thread that reads the socket
        (the keeper, or another call's), in order, with no hand-off to this thread. So
        `on_reply` must be quick and must not call predd: every reply waits behind it.
        When it returns False (or raises), the call is cancelled in predd (a generate
        stops after its current step) and its later replies are dropped. Returns the
        last reply (its end awaited, so the cache is settled; once cancelled, for at most
        CANCEL_TIMEOUT_S); raises its error, or what `on_reply` raised. `timeout`: the
        longest wait for any reply. A call to predd from inside `on_reply` raises EDEADLK
        (its reply would wait for the thread making it)."""
        inbox = _Delivered(self, on_reply)
        rid = None
        with self._waiting_lock:
            self._delivering += 1
        try:
            rid, _ = self._send(op, fields, (), inbox)
            self._wanted.set()
            cancelled = 0.0         # when it was cancelled
            while True:
                try:
                    item = inbox.ended.get(timeout=FOLLOW_S)
                except queue.Empty:
                    now = time.monotonic()
                    if self._closed:
                        raise LipError("EBADF", "client is closed") from None
                    if cancelled and now - cancelled > CANCEL_TIMEOUT_S:
                        item = LipError("ETIMEDOUT", f"predd at {self.addr} did not end a "
                                        f"cancelled {op} in {CANCEL_TIMEOUT_S:g}s")
                        break
                    if timeout is not None and now - inbox.heard > timeout and not cancelled:
                        inbox.leaving = True
                        inbox.error = LipError("ETIMEDOUT", f"no reply from predd at "
                                               f"{self.addr} in {timeout:.1f}s")
                        item = _LEAVE
                    else:
                        self._wanted.set()    # (the socket was busy when it was asked)
                        continue
                if item is _LEAVE:
                    if not cancelled:
                        cancelled = time.monotonic()
                        self._cancel(rid)
                    continue
                break
            if inbox.error is not None:
                raise inbox.error
            if isinstance(item, LipError):
                raise item
            header, _ = item
            if not header.get("ok"):
                raise _refusal(header)
            return header
        finally:
            with self._waiting_lock:
                self._delivering -= 1
            if rid is not None:
                self._forget(rid)

    def _cancel(self, rid: int) -> None:
        """Cancel the streaming call `rid` in predd (a generate stops after its step)."""
        try:
            self.call("cancel", timeout=CANCEL_TIMEOUT_S, target=rid)
        except LipError:      # it ended meanwhile (ESRCH), or predd is gone
            pass

    def ask(self, op: str, frames: tuple[bytes, ...] = (), timeout: float | None = None,
            **fields) -> Reply:
        """One request's reply as its record (symphony_protocol.REPLIES: a KvReply for
        kv_stat, a PredLogits for a raw pred, ...). Raises LipError."""
        header, extra = self.request(op, frames, timeout, **fields)
        return decode_reply(op, header, extra)

    def ask_stream(self, op: str, timeout: float | None = None, **fields) -> Iterator[Reply]:
        """`stream`, as records: GenerateChunks, then the one GenerateReply."""
        for header in self.stream(op, timeout, **fields):
            yield decode_reply(op, header)

    def logits_buffer(self, grow: bool = False) -> LogitsBuffer | None:
        """This client's logits buffer (ipc only): a sealed memfd that predd maps
        (hello's `logits_fd`), set up by the first raw pred with `SLOTS` rows and, once,
        with `MOST_SLOTS` when a call finds every slot taken (`grow`: a threaded LIP);
        None where predd or this process cannot share one (a sandbox, an older predd, a
        refusal: `logits_refused` says why), and raw rows come as frames."""
        if self._logits_asked and not (grow and self._may_grow()):
            return self.logits
        with self._logits_lock:
            if not self._logits_asked:
                self._logits_asked = True
                if self.addr.startswith("ipc://"):
                    self._share_logits(SLOTS)
            elif grow and self._may_grow():
                self._share_logits(MOST_SLOTS)
            return self.logits

    def _may_grow(self) -> bool:
        return self.logits is not None and self.logits.slots < MOST_SLOTS

    def _share_logits(self, slots: int) -> None:
        """A new buffer of `slots` rows for predd to map, or none where refused. Either
        way predd has dropped the one before: calls in flight with it get frames, and
        it is unmapped when the last of them lets go of it."""
        buffer, self.logits = None, None
        try:
            buffer = LogitsBuffer.create(self.call("info")["vocab_size"], slots)
            if buffer is not None:
                reply = self.call("hello", **self._hello, logits_fd=buffer.fd,
                                  logits_slots=buffer.slots)
                self.logits_refused = reply.get("logits_buffer", "")
                if reply.get("logits_slot_bytes") == buffer.slot_bytes and not self._closed:
                    buffer.close_fd()
                    self.logits, buffer = buffer, None
        except LipError as exc:       # e.g. an older predd: no such hello field
            self.logits_refused = f"{exc.code}: {exc.message}"
        finally:
            if buffer is not None:
                buffer.close()

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
        if getattr(self, "_logits_lock", None) is not None:
            with self._logits_lock:         # not while logits_buffer() sets one up
                if self.logits is not None:
                    self.logits.close()
        self._stop.set()
        self._wanted.set()
        self._thread.join(timeout=5)
        self._fail_all(LipError("EBADF", "client is closed"))
        os.eventfd_write(self._wake, 1)        # wakes a reader's poll: it sees the error
        with self._sock_lock:
            for sock in (self._dealer, self._monitor):
                sock.close(0)
            if self._stream is not None:
                self._stream.close()
        self._ctx.term()

    # ------------------------------------------------------------ the socket

    def _keep(self) -> None:
        """The keeper thread: the socket's work (pings, the connection's health, replies
        no one waits for) whenever no caller holds it, and the reader for everyone while
        several calls wait (one reader, not a relay race between the callers)."""
        while not self._stop.is_set():
            self._wanted.wait(KEEP_S)
            self._wanted.clear()
            if self._stop.is_set() or not self._sock_lock.acquire(blocking=False):
                continue                  # a caller reads; it wakes us when it is done
            try:
                self._pump(0.0)
                while (len(self._waiting) > 1 or self._delivering) \
                        and not self._stop.is_set():
                    self._pump(self._ping_every / 2 if not self._outbox else RETRY_S)
            finally:
                self._release(None)

    def _release(self, rid: int | None) -> None:
        """Let go of the socket. If one other call still waits with nothing to read, it
        reads for itself (told so through its queue); if more do, the keeper reads."""
        self._sock_lock.release()
        with self._waiting_lock:
            others = [q for r, q in self._waiting.items() if r != rid and q.empty()]
        if len(others) == 1:
            others[0].put(_READ)
        elif others:
            self._wanted.set()

    def _read_until(self, inbox: queue.SimpleQueue, left: float | None) -> None:
        """As the reader: pump until `inbox` has something or `left` seconds pass."""
        end = None if left is None else time.monotonic() + left
        while inbox.empty() and not self._closed:
            wait = self._ping_every / 2 if not self._outbox else RETRY_S
            if end is not None:
                wait = min(wait, end - time.monotonic())
                if wait <= 0:
                    return
            self._pump(wait)

    def _open_stream(self, first: bool = False) -> bool:
        """Connect to predd's local stream socket; whether it answered. The first time
        (in the constructor) waiting up to `dead_after_s` for room in predd's listen
        queue, later not at all: a reader never blocks on it."""
        sock = None
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            if first:
                sock.settimeout(self.dead_after_s)
            else:
                sock.setblocking(False)
            sock.connect(self._stream_path)
        except OSError:             # no such socket, refused, a full queue, no descriptor
            if sock is not None:
                sock.close()
            return False
        sock.setblocking(False)
        self._stream, self._stream_reader = sock, Reader(MAX_REPLY_BYTES)
        self._stream_writer = Writer(sock)
        self._poller.register(sock.fileno(), select.POLLIN)   # the stream: poll(2)'s flags
        self._connected = True
        self._last_heard = time.monotonic()
        return True

    def _close_stream(self, now: float) -> None:
        """The stream closed under us: predd ended (or dropped) the session, so no reply
        can come to the calls that wait; the next send connects again."""
        self._poller.unregister(self._stream.fileno())
        self._stream.close()
        self._stream = self._stream_reader = self._stream_writer = None
        self._connected = False
        self._down_since = now
        error = self._stream_error or LipError("EIO", f"predd at {self.addr} closed the "
                                               "connection")
        self._stream_error = None
        self._fail_all(error)

    def _send_now(self, message: list) -> bool:
        """Send one message (on the stream: or queue it behind an earlier one's end);
        False when it must wait (not connected)."""
        if self._stream_path is None:
            try:
                self._dealer.send_multipart(message, NOBLOCK, copy=False)
            except zmq.Again:   # not connected (yet): retry, or fail in _pump
                return False
            return True
        if self._stream is None:
            if not self._open_stream():
                return False
            self._stream_write([encode_request("hello", -1, self._hello)])   # a new session
        return self._stream_write(message)

    def _stream_write(self, message: list) -> bool:
        writer = self._stream_writer
        waited = len(writer)
        try:
            writer.write(message)
        except OSError:
            return False          # closed: seen by the next read
        if len(writer) and not waited:   # the rest when the socket takes it
            self._poller.register(self._stream.fileno(), select.POLLIN | select.POLLOUT)
        return True

    def _flush(self, now: float) -> None:
        if self._stream_writer is not None and len(self._stream_writer):
            try:
                if self._stream_writer.flush():
                    self._poller.register(self._stream.fileno(), select.POLLIN)
            except OSError:
                pass              # closed: seen by the next read
        while self._outbox:
            rid, message = self._outbox[0]
            if rid == -1 or rid in self._waiting:    # (else its caller has its answer)
                if not self._send_now(message):
                    return
                self._last_sent = now
            self._outbox.popleft()

    def _pump(self, wait_s: float) -> None:
        """One round of the socket's work, waiting up to `wait_s` for something to come:
        send what is queued, deliver replies, follow the connection, ping, and fail the
        waiting calls when predd is gone."""
        events = dict(self._poller.poll(wait_s * 1e3))
        now = time.monotonic()
        if self._wake in events:
            try:
                os.eventfd_read(self._wake)      # (before taking what it announced)
            except BlockingIOError:              # another reader took it: still drain
                pass
        while self._handed:          # every round, so a wake read elsewhere loses nothing
            self._outbox.append(self._handed.popleft())
        if self._stream is not None and self._stream.fileno() in events:
            self._read_stream(now)
        self._flush(now)
        if self._dealer in events:
            for frames in _received(self._dealer, self._dealer.recv_multipart):
                self._last_heard = now
                self._deliver(frames)
        if self._monitor in events:
            for event in _received(self._monitor,
                                   lambda flags: recv_monitor_message(self._monitor, flags)):
                self._connected = event["event"] == zmq.EVENT_CONNECTED
                self._last_heard = self._down_since = now
        if now - self._last_sent >= self._ping_every:
            if not self._outbox and (self._stream is not None or self._stream_path is None):
                self._send_now([encode_request("ping", -1, {})])   # (never to reconnect)
            self._last_sent = now
        if not self._waiting:
            return
        if not self._connected and now - self._down_since > self.dead_after_s:
            self._outbox.clear()
            self._fail_all(LipError("EIO", f"predd at {self.addr} is unreachable"))
        elif self._connected and now - self._last_heard > self.silent_after_s:
            self._fail_all(LipError("EIO", f"predd at {self.addr} is not answering "
                                    f"({now - self._last_heard:.0f}s of silence)"))
            self._last_heard = now

    def _read_stream(self, now: float) -> None:
        got = self._stream_reader.receive(self._stream, RECV_BYTES)
        if got < 0:
            self._close_stream(now)
            return
        if not got:
            return
        self._last_heard = now
        try:
            messages = self._stream_reader.feed(b"")
        except ProtocolError:     # not predd's framing: nothing more can be read
            self._close_stream(now)
            return
        for frames in messages:
            self._deliver(frames)

    def _deliver(self, frames: list[bytes]) -> None:
        header = _header(frames)
        if header is None:
            return
        rid = header.get("rid")
        if rid is None and isinstance(header.get("error"), dict) and self._stream is not None:
            err = header["error"]           # predd refuses this stream (before closing it)
            self._stream_error = LipError(err.get("code", "EIO"), err.get("message", ""))
            self._stream_error.from_predd = True
            return
        inbox = self._waiting.get(rid)      # a dict read is atomic; the lock guards writes
        if inbox is not None:
            inbox.put((header, frames[1:]))

    def _fail_all(self, error: LipError) -> None:
        with self._waiting_lock:
            inboxes = list(self._waiting.values())
            self._waiting.clear()
        for inbox in inboxes:
            inbox.put(error)


def _header(frames: list[bytes]) -> dict | None:
    """A reply's header map; None where it is not one."""
    try:
        header = msgpack.unpackb(frames[0], raw=False)
    except Exception:
        return None
    return header if isinstance(header, dict) else None


def _received(sock: zmq.Socket, receive: Callable[[int], T]) -> list[T]:
    """`receive(zmq.NOBLOCK)` while `sock` has a message: asked with ZMQ_EVENTS, not by
    a zmq.Again raised at the end (an exception every round, on a pred loop's path).
    Messages come as bytes: the one copy that Frame.bytes made before."""
    got = []
    while sock.getsockopt(EVENTS) & POLLIN:
        try:
            got.append(receive(NOBLOCK))
        except zmq.Again:       # EVENTS said there was one: it went (a reset connection)
            break
    return got
