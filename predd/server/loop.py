"""predd's loop: a ZeroMQ ROUTER socket feeding the engine, one thread.

Each turn drains waiting messages — at most DRAIN_MAX of them or DRAIN_S seconds'
worth, so that a flood of requests cannot starve stepping — then either runs a step
(the scheduler says launch), or sleeps on the socket until a message arrives or the
adaptive-launch hold ends. Leases are checked twice a second, against the last moment
the socket was seen empty: a ping still waiting in it (behind a long step or a flood)
keeps its session alive. SIGTERM/SIGINT end the loop cleanly.

Every message is handed to the engine with its sender's `Peer` (on ipc the kernel's
uid/gid/pid, which libzmq attaches to each frame as `Peer-Address`). ZeroMQ limits:
an inbound frame larger than the engine's largest legitimate request (a kv_import of a
uid's whole page quota) disconnects its sender; at most HWM messages queue per peer in
each direction — a peer that does not read its replies loses the excess (ROUTER drops
them; it never blocks the loop), and one that sends faster than predd drains is held
back by its own socket. libzmq fair-queues input across peers.

Beside an ipc endpoint the loop also serves the local stream socket
(predd/server/streams.py): the same messages from local clients without ZeroMQ's I/O
threads, polled with the ZeroMQ socket in one `zmq.Poller`.
"""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import time

import zmq

from symphony_protocol import pack
from symphony_protocol.stream import stream_path
from predd.engine.core import Engine, Flight
from predd.server.identity import peer_of, transport_of
from predd.server.streams import Streams

IDLE_POLL_S = 0.25
ROOM_POLL_S = 0.01   # how often calls waiting for memory are offered it again
LEASE_CHECK_S = 0.5
DRAIN_MAX = 256      # messages handled per turn before the scheduler gets a look in
DRAIN_S = 0.005
FLY_BUDGET = 16      # messages handled a turn while a step's pass runs: its end is seen soon
HWM = 1024           # messages queued per peer, each direction


class Server:
    def __init__(self, addr: str, engine_factory, log=None, per_uid: int = 0,
                 trusted_uid: int = -1, overlap: bool = True) -> None:
        """`per_uid`: local stream connections a uid may hold (0: no limit) but
        `trusted_uid`'s. `overlap`: answer what may be answered while a step's pass runs
        on the device (`_fly`)."""
        self.addr = addr
        self.log = log or (lambda msg: print(f"predd: {msg}", file=sys.stderr, flush=True))
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.transport = transport_of(addr)
        self.engine: Engine = engine_factory(self.send, self.log)
        # Before bind: connections copy the socket's options when they are made.
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.engine.max_message_bytes)
        self._bind(addr)
        self.streams: Streams | None = None
        if self.transport == "ipc":
            try:
                self.streams = Streams(stream_path(self.addr), self.engine.max_message_bytes,
                                       HWM, self.log, per_uid, trusted_uid)
            except OSError as exc:   # e.g. a path too long for a Unix socket's name
                self.log(f"no local stream ({exc}); local clients use ZeroMQ")
        # what `_fly` reads while a pass runs: the local streams; a device step's answers
        # to them are held until the next launch
        self.flies = overlap and self.streams is not None
        self.engine.hold_for = self.streams.owns if self.flies else None
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if self.streams is not None:
            self.poller.register(self.streams.fileno(), zmq.POLLIN)
        self.running = True
        self.emptied_at = 0.0   # every message that arrived before this has been handled
        self.stream_work = False   # whole messages or unread bytes left on the streams

    def _bind(self, addr: str) -> None:
        if addr.startswith("ipc://"):
            path = addr[len("ipc://"):]
            rundir = os.path.dirname(os.path.abspath(path))
            os.makedirs(os.path.dirname(rundir), exist_ok=True)
            try:
                os.mkdir(rundir, 0o755)
                os.chmod(rundir, 0o755)   # whatever the umask: clients must reach the socket
            except FileExistsError:
                pass
            st = os.lstat(rundir)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
                # Someone else's (or a shared) directory could swap our socket for theirs.
                self.log(f"EPERM: run directory {rundir} must be a directory owned by uid "
                         f"{os.geteuid()} and not writable by group or others (it is "
                         f"{'a link' if stat.S_ISLNK(st.st_mode) else oct(st.st_mode & 0o7777)}, "
                         f"uid {st.st_uid}); refusing to start")
                raise SystemExit(2)
            if os.path.lexists(path):
                os.unlink(path)   # a stale socket of a dead predd
        self.sock.bind(addr)
        if addr.startswith("ipc://"):
            os.chmod(addr[len("ipc://"):], 0o666)   # peers are told apart by SO_PEERCRED
        if addr.endswith(":0"):
            self.addr = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, identity: bytes, header: dict, frames: list[bytes]) -> None:
        if self.streams is not None and self.streams.send(identity, [pack(header), *frames]):
            return
        try:
            self.sock.send_multipart([identity, pack(header), *frames], copy=False)
        except zmq.ZMQError as exc:   # the peer is gone: nothing to tell
            self.log(f"reply dropped: {exc}")

    def _corked(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.streams is None else self.streams.corked()

    def stop(self, *_args) -> None:
        self.running = False

    def serve(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        print(f"ready {self.addr}", flush=True)
        engine, sched = self.engine, self.engine.scheduler
        next_lease_check = 0.0
        while self.running:
            self._drain()
            now = time.monotonic()
            if now >= next_lease_check:
                engine.expire_sessions(self.emptied_at)
                engine.runner.keepalive()
                next_lease_check = now + LEASE_CHECK_S
            wait = sched.wait_time(now)
            if wait == 0.0:
                stepped = self._step()
                if stepped:
                    continue
                wait = ROOM_POLL_S   # every queued call waits for room on the device
            timeout = IDLE_POLL_S if wait is None else min(wait, IDLE_POLL_S)
            engine.release_held()
            self.poller.poll(0 if self.stream_work else timeout * 1e3)
            if wait is not None:
                sched.note_wait(min(time.monotonic() - now, wait))
        self.close()

    def _step(self) -> bool:
        """One step of the engine, if any call is ready (whether one ran): launched, flown
        (`_fly`), landed (its replies corked); then the sessions of connections that
        closed meanwhile end."""
        with self._corked():
            try:
                flight = self.engine.launch()
            finally:
                self.engine.release_held()   # the last step's answers: their next steps flying
        if flight is None:
            return False
        ended = self._fly(flight) if self.flies else []
        try:
            with self._corked():
                self.engine.land(flight)
        finally:
            for identity in ended:
                self._ended(identity)
        return True

    def _fly(self, flight: Flight) -> list[bytes]:
        """While the step's pass runs on the device (until `flight.ready()`; on a CPU it
        is done when launched): the local streams' preds that take their object's
        speculation are answered now (Intake.handle_in_flight), the parts of the next
        step that need no step of their own. Every other message waits, in its
        connection's order, for the turns after the step; so does the end of a session
        whose connection closed (the identities returned). ZeroMQ is not read."""
        ended: list[bytes] = []
        counters, streams = self.engine.counters, self.streams
        times = counters.time_s
        while not flight.ready():
            started, cpu, handled = time.monotonic(), time.thread_time(), counters.requests
            try:
                with streams.corked():
                    streams.turn(self._handle, ended.append, FLY_BUDGET,
                                 take=self._take_in_flight)
            except Exception as exc:   # a bug must not take the daemon down
                self.log(f"internal error on the local stream: {type(exc).__name__}: {exc}")
                break
            finally:
                if counters.requests != handled:    # a turn that answered something
                    times["in_flight"] += time.monotonic() - started   # within `forward`
                    times["requests_cpu"] += time.thread_time() - cpu
        return ended

    def _take_in_flight(self, identity: bytes, frames: list[bytes], peer) -> bool:
        return self.engine.handle_in_flight(identity, frames, time.monotonic(), peer)

    def _drain(self) -> None:
        """Handle waiting messages: the streams' (at most DRAIN_MAX), then ZeroMQ's.
        `emptied_at` moves, to the moment before the streams were looked at, only when
        both were left with nothing. A turn that handled messages has its wall and thread
        CPU time counted once (a thread's CPU clock is a system call: not one a message);
        an empty one is not counted."""
        counters = self.engine.counters
        started, cpu, handled = time.monotonic(), time.thread_time(), counters.requests
        try:
            self._drain_from(started)
        finally:
            if counters.requests != handled:
                counters.time_s["requests"] += time.monotonic() - started
                counters.time_s["requests_cpu"] += time.thread_time() - cpu

    def _drain_from(self, started: float) -> None:
        deadline = started + DRAIN_S
        if self.streams is not None:
            try:
                with self.streams.corked():
                    self.stream_work = self.streams.turn(self._handle, self._ended, DRAIN_MAX)
            except Exception as exc:   # a bug must not take the daemon down
                self.log(f"internal error on the local stream: {type(exc).__name__}: {exc}")
        for _ in range(DRAIN_MAX):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if not self.stream_work:
                    self.emptied_at = started
                return
            if frames[0].bytes[:1] == b"\x01":   # a stream's kind of identity: not ZeroMQ's
                continue
            try:
                address = frames[-1].get("Peer-Address")
            except zmq.ZMQError:   # no such property on this transport
                address = None
            now = time.monotonic()
            self.engine.handle(frames[0].bytes, [f.bytes for f in frames[1:]], now,
                               peer_of(self.transport, address))
            if now > deadline:
                return

    def _handle(self, identity: bytes, frames: list[bytes], peer) -> None:
        self.engine.handle(identity, frames, time.monotonic(), peer)

    def _ended(self, identity: bytes) -> None:
        session = self.engine.sessions.of_identity(identity)
        if session is not None:
            self.engine.end_session(session, "connection closed")

    def close(self) -> None:
        self.log("stopping")
        with self._corked():
            self.engine.release_held()
        if self.streams is not None:
            self.streams.close()
        self.sock.close(0)
        if self.addr.startswith("ipc://"):
            try:
                os.unlink(self.addr[len("ipc://"):])
            except FileNotFoundError:
                pass
