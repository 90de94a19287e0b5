"""The predd replicas of `symphony serve`: which there are, which are up, what runs on each.

A replica is named by its address, exactly as kvfsd is given it, in order (replica 0
first). `--replicas N` makes N local ones: replica 0 at `ipc://RUNDIR/predd.sock` (as
with one), replica k at `ipc://RUNDIR/predd-k.sock`, each a predd child with the same
flags (plus `--threads cores // N` unless the operator chose, `--device cuda:k` for
`--device cuda`, and its own swap directory). `--predd ADDR` adds a running remote predd after them; the gateway reaches
it with $SYMPHONY_TOKEN and checks it with a `ping` every PING_EVERY_S.

Lifetime rules:
* A local replica is up from its `ready` line until its process exits. With N > 1 a
  local replica that exits is logged and started again after a pause that doubles
  while it keeps dying (1 s .. 30 s; back to 1 s once it stayed up a minute); the
  others serve meanwhile. With N = 1 `watch()` returns its exit status instead (the
  supervisor stops everything, as before replicas).
* `inflight[i]` counts runs and OpenAI requests placed on replica i and not ended;
  `take`/`release` pair up, and are called with no await between placement and `take`.
* `on_up(i)` / `on_down(i)` hooks (the OpenAI bridges) hear every change of a local
  replica's state.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gatewayd.daemons import Daemon
from liblip.client import Client, LipError

PING_EVERY_S = 2.0
FIRST_PAUSE_S, MAX_PAUSE_S, STABLE_S = 1.0, 30.0, 60.0


def local_addr(rundir: str, index: int) -> str:
    name = "predd.sock" if index == 0 else f"predd-{index}.sock"
    return f"ipc://{os.path.join(rundir, name)}"


def _flag_value(args: list[str], flag: str) -> str | None:
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def predd_argv(rundir: str, index: int, count: int, model: str | None,
               predd_args: list[str]) -> list[str]:
    """The command line of local replica `index` of `count`."""
    argv = [sys.executable, "-m", "predd", "--rundir", rundir,
            *(["--model", model] if model else []), *predd_args]
    if count > 1 and _flag_value(predd_args, "--threads") is None:
        cores = len(os.sched_getaffinity(0))
        argv += ["--threads", str(max(1, cores // count))]
    if count > 1 and _flag_value(predd_args, "--device") == "cuda":
        argv += ["--device", f"cuda:{index}"]       # one GPU each
    if index > 0:   # later flags win in argparse: its own socket and swap directory
        swap = _flag_value(predd_args, "--swap-dir") or os.path.join(rundir, "swap")
        argv += ["--addr", local_addr(rundir, index), "--swap-dir", f"{swap}-{index}"]
    return argv


def near_holdings(mount: str, paths: list[str], addrs: list[str]) -> list[int]:
    """Tokens the cache files `paths` hold on each replica (home from `user.kv.replica`,
    tokens from `user.kv.tokens`, read as the gateway: root). A path is relative to the
    mount or absolute inside it; one outside it, missing, unreadable, or homed on an
    address not in `addrs` is ignored."""
    held = [0] * len(addrs)
    root = os.path.normpath(mount)
    for path in paths:
        full = os.path.normpath(os.path.join(root, path))   # an absolute path stays itself
        if not full.startswith(root + os.sep):
            continue
        try:
            home = os.getxattr(full, "user.kv.replica", follow_symlinks=False).decode()
            tokens = int(os.getxattr(full, "user.kv.tokens", follow_symlinks=False))
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if home.strip() in addrs:
            held[addrs.index(home.strip())] += max(0, tokens)
    return held


@dataclass
class Replica:
    index: int
    addr: str
    daemon: Daemon | None = None          # None: a remote predd (--predd)
    up: bool = False
    inflight: int = 0
    restarts: int = 0
    _client: Client | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def local(self) -> bool:
        return self.daemon is not None

    def call(self, op: str, timeout: float | None = 5.0, **fields) -> dict:
        """One predd request (from a thread). A connection that failed is dropped, and the
        next call opens a new one (a restarted predd, a tcp session to say hello again)."""
        with self._lock:
            if self._client is None:
                self._client = Client(self.addr, name="gatewayd")
            client = self._client
        try:
            return client.call(op, timeout=timeout, **fields)
        except LipError as exc:
            if exc.code == "EIO":
                self.drop_client(client)
            raise

    def drop_client(self, client: Client | None = None) -> None:
        with self._lock:
            if self._client is None or (client is not None and client is not self._client):
                return
            old, self._client = self._client, None
        old.close()


class Replicas:
    def __init__(self, replicas: list[Replica], log: Callable[[str], None]) -> None:
        self.all = replicas
        self.log = log
        self.closing = False
        self.on_up: list[Callable[[int], None]] = []
        self.on_down: list[Callable[[int], None]] = []

    @classmethod
    def plan(cls, rundir: str, count: int, remote: list[str], model: str | None,
             predd_args: list[str], log: Callable[[str], None]) -> Replicas:
        out = []
        for i in range(count):
            name = "predd" if count == 1 else f"predd[{i}]"
            daemon = Daemon(name, predd_argv(rundir, i, count, model, predd_args),
                            strip="predd: ")
            out.append(Replica(i, local_addr(rundir, i), daemon))
        out += [Replica(count + j, addr) for j, addr in enumerate(remote)]
        return cls(out, log)

    # ------------------------------------------------------------ views

    @property
    def local(self) -> list[Replica]:
        return [r for r in self.all if r.local]

    @property
    def addrs(self) -> list[str]:
        return [r.addr for r in self.all]

    @property
    def live_addrs(self) -> list[str]:
        return [r.addr for r in self.all if r.up]

    def index_of(self, addr: str) -> int | None:
        for r in self.all:
            if r.addr == addr:
                return r.index
        return None

    def loads(self) -> list[int | None]:
        """Work in flight per replica, None for those new work may not go to: down ones,
        and remote ones while a local one is up."""
        local_up = any(r.up for r in self.local)
        return [r.inflight if r.up and (r.local or not local_up) else None for r in self.all]

    def take(self, index: int) -> None:
        self.all[index].inflight += 1

    def release(self, index: int) -> None:
        self.all[index].inflight = max(0, self.all[index].inflight - 1)

    def call(self, addr: str, op: str, timeout: float | None = 5.0, **fields) -> dict:
        index = self.index_of(addr)
        if index is None:
            raise LipError("EINVAL", f"no replica {addr}")
        return self.all[index].call(op, timeout=timeout, **fields)

    # ------------------------------------------------------------ lifetime

    async def start(self, timeout: float) -> None:
        """Start every local replica at once; RuntimeError when one does not start."""
        results = await asyncio.gather(*(r.daemon.start(timeout) for r in self.local),
                                       return_exceptions=True)
        for r, result in zip(self.local, results):
            if isinstance(result, BaseException):
                raise result
            r.addr = result or r.addr
            r.up = True
        for r in self.all:
            if not r.local:
                try:
                    await asyncio.to_thread(r.call, "ping", 5.0)
                    r.up = True
                except LipError as exc:
                    self.log(f"replica {r.addr} does not answer yet ({exc})")

    async def watch(self) -> str:
        """Keep the replicas going: ping remote ones; with one local replica return its
        exit status when it exits (the server stops), with more restart dead ones and
        return only when cancelled."""
        tasks = [asyncio.create_task(self._ping(r)) for r in self.all if not r.local]
        try:
            if len(self.local) == 1:
                return str(await self.local[0].daemon.wait())
            tasks += [asyncio.create_task(self._keep(r)) for r in self.local]
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
        return "stopped"

    def _set(self, r: Replica, up: bool) -> None:
        if r.up == up:
            return
        r.up = up
        for hook in (self.on_up if up else self.on_down):
            hook(r.index)

    async def _keep(self, r: Replica) -> None:
        pause, since = FIRST_PAUSE_S, time.monotonic()
        while not self.closing:
            status = await r.daemon.wait()
            if self.closing:
                return
            self._set(r, False)
            await asyncio.to_thread(r.drop_client)
            if time.monotonic() - since >= STABLE_S:
                pause = FIRST_PAUSE_S
            self.log(f"{r.daemon.name} ({r.addr}) exited ({status}); starting it again "
                     f"in {pause:g} s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)
            if self.closing:
                return
            try:
                await r.daemon.start(600.0)
            except RuntimeError as exc:
                self.log(f"{r.daemon.name}: {exc}")
                continue
            r.restarts += 1
            since = time.monotonic()
            self.log(f"{r.daemon.name} ({r.addr}) is back")
            self._set(r, True)

    async def _ping(self, r: Replica) -> None:
        while not self.closing:
            try:
                await asyncio.to_thread(r.call, "ping", 2.0)
                up = True
            except LipError:
                up = False
            if up != r.up:
                self.log(f"replica {r.addr} is {'up' if up else 'down'}")
            self._set(r, up)
            await asyncio.sleep(PING_EVERY_S)

    async def stop(self) -> None:
        """Stop the local predds (all at once) and close the gateway's connections."""
        self.closing = True
        for r in self.all:
            await asyncio.to_thread(r.drop_client)
        await asyncio.gather(*(r.daemon.stop() for r in self.local), return_exceptions=True)
        for r in self.all:
            r.up = False
