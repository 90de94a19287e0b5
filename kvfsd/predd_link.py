"""predd as kvfsd sees it: async calls that never hang, and predd's liveness.

liblip's `Client` is thread-safe and blocking (pyzmq has no trio integration), so each
call runs in a worker thread. Three things bound how long a FUSE request waits:
* `Timeouts.call_s` on every call (a live predd may defer a request behind the calls
  queued on the same object; a dead one answers nothing),
* the client's own dead-peer rule (`dead_after_s` of silence, pings included -> EIO),
* a liveness probe: a plain socket connect to predd's endpoint every `probe_s`. When it
  is refused, predd is gone: calls in flight are cancelled with EIO at once and new ones
  fail fast until predd answers again.

`poll` also tells when predd is a different process than before (a restart: its
capabilities are all gone), from its reported uptime.
"""
from __future__ import annotations

import errno
import os
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import trio

from liblip.client import Client, LipError

GONE = ("EIO", "ETIMEDOUT")     # predd did not answer: the FUSE request gets EIO


@dataclass(frozen=True)
class Timeouts:
    call_s: float = 10.0        # a control op on a live, busy predd
    stat_s: float = 0.5         # stat's wait for fresh figures (then: last seen)
    bulk_s: float = 120.0       # kv_export / kv_import of a whole cache
    dead_after_s: float = 5.0   # liblip's dead-peer rule
    probe_s: float = 0.5        # liveness probe period
    poll_s: float = 1.0         # stats poll period (restart detection, deferred frees)


class PreddError(LipError):
    """A failed predd call; `.code` is the errno name predd (or liblip) gave."""

    @property
    def errno(self) -> int:
        if self.code in GONE:
            return errno.EIO
        return getattr(errno, self.code, errno.EIO)


class PreddLink:
    """kvfsd's one link to predd: a liblip client used from trio, whether predd is up
    (`up`), which predd process it is (`instance`), and its last `info` and `stats`."""

    def __init__(self, addr: str, log, timeouts: Timeouts = Timeouts()) -> None:
        self.addr = addr
        self.log = log
        self.t = timeouts
        self.client: Client | None = None
        self.up = False
        self.instance: float | None = None   # predd's start, on CLOCK_MONOTONIC
        self.info: dict = {}
        self.stats: dict = {}
        self._inflight: set[trio.CancelScope] = set()

    # ------------------------------------------------------------ connection

    def _make_client(self) -> Client | None:
        """A connected Client, or None when predd did not answer `hello` (a failed
        Client leaves nothing behind; `poll` calls `connect` again later)."""
        try:
            return Client(self.addr, lease_s=30.0, name="kvfsd",
                          dead_after_s=self.t.dead_after_s)
        except LipError:
            return None

    async def connect(self) -> bool:
        """Make the client, unless predd's endpoint refuses connections (then kvfsd
        mounts anyway and the monitor connects later). Whether there is a client."""
        if self.client is None:
            if await trio.to_thread.run_sync(_endpoint_accepts, self.addr) is False:
                return False
            self.client = await trio.to_thread.run_sync(self._make_client)
        return self.client is not None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()

    # ------------------------------------------------------------ calls

    async def request(self, op: str, *, timeout: float | None = None, frames=(),
                      probe: bool = False, **fields) -> tuple[dict, list]:
        """One predd request; PreddError on failure (EIO at once while predd is known
        to be down, unless `probe`)."""
        if self.client is None or (not self.up and not probe):
            raise PreddError("EIO", f"predd at {self.addr} is not reachable")
        client = self.client
        wait = timeout or self.t.call_s

        def blocking():
            return client.request(op, frames=frames, timeout=wait, **fields)

        with trio.CancelScope() as scope:
            self._inflight.add(scope)
            try:
                result = await trio.to_thread.run_sync(blocking, abandon_on_cancel=True)
            except LipError as exc:
                if exc.code == "EIO":
                    self._set_up(False, exc.message)
                raise PreddError(exc.code, exc.message) from None
            finally:
                self._inflight.discard(scope)
        if scope.cancelled_caught:
            raise PreddError("EIO", f"predd at {self.addr} went away")
        self._set_up(True)
        return result

    async def call(self, op: str, **kwargs) -> dict:
        return (await self.request(op, **kwargs))[0]

    def _set_up(self, up: bool, why: str = "") -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            self.log(f"predd at {self.addr} is answering")
        else:
            self.log(f"predd at {self.addr} is not reachable ({why}): "
                     "cache operations fail with EIO until it is back")
            for scope in list(self._inflight):
                scope.cancel()

    # ------------------------------------------------------------ liveness

    async def probe(self) -> None:
        """Mark predd down at once when its endpoint refuses connections."""
        if not self.up:
            return
        alive = await trio.to_thread.run_sync(_endpoint_accepts, self.addr)
        if alive is False:
            self._set_up(False, "endpoint refuses connections")

    async def poll(self) -> bool:
        """Ask predd for its figures; whether it is a new predd process (or the first
        one seen), in which case kvfsd's capabilities must be re-validated."""
        if not await self.connect():
            return False
        if not self.up and await trio.to_thread.run_sync(_endpoint_accepts, self.addr) is False:
            return False                      # still gone: do not queue requests for it
        try:
            stats = await self.call("stats", probe=True, timeout=2.0)
        except PreddError:
            return False
        start = time.monotonic() - float(stats.get("uptime_s", 0.0))
        self.stats = stats
        if self.instance is not None and abs(start - self.instance) < 2.0:
            return False
        try:   # a new predd: introduce ourselves (name, lease) and learn its shape
            await self.call("hello", probe=True, client="kvfsd", pid=os.getpid(),
                            uid=os.getuid(), lease_s=30.0)
            self.info = await self.call("info", probe=True)
        except PreddError:
            return False
        self.instance = start
        return True


def _endpoint_accepts(addr: str) -> bool | None:
    """True/False when a connect to a ZeroMQ ipc:// or tcp:// endpoint works or is
    refused; None for other transports or unclear failures."""
    try:
        if addr.startswith("ipc://"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target = addr[len("ipc://"):]
        elif addr.startswith("tcp://"):
            url = urlsplit(addr)
            host = url.hostname or "127.0.0.1"
            if host == "*":
                host = "127.0.0.1"
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                                 socket.SOCK_STREAM)
            target = (host, url.port)
        else:
            return None
    except (ValueError, OSError):
        return None
    sock.settimeout(1.0)
    try:
        sock.connect(target)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return None
    finally:
        sock.close()
