"""predd's loop: a ZeroMQ ROUTER socket feeding the engine, one thread.

Each turn drains every waiting message, then either runs a step (the scheduler says
launch), or sleeps on the socket until a message arrives or the adaptive-launch hold
ends. Leases are checked twice a second. SIGTERM/SIGINT end the loop cleanly.
"""
from __future__ import annotations

import os
import signal
import stat
import sys
import time

import zmq

from liblip.protocol import pack
from predd.engine import Engine

IDLE_POLL_S = 0.25
LEASE_CHECK_S = 0.5


class Server:
    def __init__(self, addr: str, engine_factory, log=None) -> None:
        self.addr = addr
        self.log = log or (lambda msg: print(f"predd: {msg}", file=sys.stderr, flush=True))
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self._bind(addr)
        self.engine: Engine = engine_factory(self.send, self.log)
        self.running = True

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
        try:
            self.sock.send_multipart([identity, pack(header), *frames], copy=False)
        except zmq.ZMQError as exc:   # the peer is gone: nothing to tell
            self.log(f"reply dropped: {exc}")

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
                engine.expire_sessions(now)
                next_lease_check = now + LEASE_CHECK_S
            wait = sched.wait_time(now)
            if wait == 0.0:
                engine.step()
                continue
            timeout = IDLE_POLL_S if wait is None else min(wait, IDLE_POLL_S)
            self.sock.poll(timeout * 1e3, zmq.POLLIN)
            if wait is not None:
                sched.note_wait(min(time.monotonic() - now, wait))
        self.close()

    def _drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            self.engine.handle(identity, body, time.monotonic())

    def close(self) -> None:
        self.log("stopping")
        self.sock.close(0)
        if self.addr.startswith("ipc://"):
            try:
                os.unlink(self.addr[len("ipc://"):])
            except FileNotFoundError:
                pass
