"""The gateway's side of the OpenAI LIP (`python -m openai_lip`, the openai_lip package).

The LIP runs like any program — `lip run --sandbox`, as its own uid — and speaks JSON
lines on its stdin/stdout (openai_lip/server.py's docstring has the messages). This
module starts it, waits for its `ready` line, numbers requests, and routes each reply
line to the waiting request's queue. If the LIP dies, every waiting request fails with
503 and the LIP is started again (after a pause that grows while it keeps dying).

With replicas there is one LIP per local replica (its PREDD_ADDR; its own cache
directory, MOUNT/openai/K, so its prefix cache files are homed where it computes), and
OpenAIBridges routes each request: the replica whose earlier prompts share the longest
prefix with it, under the load cap (prefix_routes.py). A replica that goes down has its
LIP stopped (`suspend`) until it is back (`resume`).
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
from collections.abc import AsyncIterator

from gatewayd.errors import ApiError
from gatewayd.launcher import Launcher
from gatewayd.meter import running_descendants
from gatewayd.prefix_routes import PrefixRoutes, prompt_text
from gatewayd.programs import Program

PROGRAM = Program("openai_lip", "openai_lip", "module")
READY_TIMEOUT_S = 120.0


class OpenAIBridge:
    def __init__(self, launcher: Launcher, uid: int, model: str | None, log,
                 cache_dir: str | None = None, name: str = "openai") -> None:
        self.launcher = launcher
        self.uid = uid
        self.model_path = model
        self.cache_dir = cache_dir
        self.name = name
        self.log = lambda msg: log(f"{name}: {msg}")
        self.available = asyncio.Event()     # its predd is up: the LIP may run
        self.available.set()
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Queue] = {}
        self.proc: asyncio.subprocess.Process | None = None
        self.model = ""
        self.ready = asyncio.Event()
        self.closing = False
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Start the LIP and keep it running; returns once it is ready."""
        self._task = asyncio.create_task(self._keep_running())
        ready = asyncio.create_task(self.ready.wait())
        done, _ = await asyncio.wait({ready, self._task}, timeout=READY_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            ready.cancel()
            raise RuntimeError("the OpenAI LIP did not become ready")

    async def _keep_running(self) -> None:
        pause = 1.0
        while not self.closing:
            await self.available.wait()
            if self.closing:
                return
            try:
                await self._run_once()
            except Exception as exc:   # noqa: BLE001 - logged, then started again
                self.log(repr(exc))
            self.ready.clear()
            self._fail_waiting("the OpenAI LIP stopped; try again")
            if self.closing:
                return
            if not self.available.is_set():      # suspended: back when its predd is
                self.log("LIP stopped while its predd is down")
                pause = 1.0
                continue
            self.log(f"LIP exited; starting it again in {pause:g} s")
            await asyncio.sleep(pause)
            pause = min(pause * 2, 30.0)

    def suspend(self) -> None:
        """Its predd went down: stop the LIP (its session died with predd) and start it
        again only after `resume`."""
        self.available.clear()
        self.ready.clear()
        proc = self.proc
        if proc is not None and proc.returncode is None:
            for pid in running_descendants(proc.pid) | {proc.pid}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def resume(self) -> None:
        self.available.set()

    async def _run_once(self) -> None:
        args = ["--model", self.model_path] if self.model_path else []
        if self.cache_dir:
            args += ["--cache-dir", self.cache_dir]
        self.proc = await asyncio.create_subprocess_exec(
            *self.launcher.argv(PROGRAM, args, self.uid, None),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd="/", start_new_session=True,
            env=self.launcher.env(PROGRAM, {}, "openai"), limit=1 << 24)
        errors = asyncio.create_task(self._log_stderr(self.proc.stderr))
        try:
            async for msg in self._lines(self.proc.stdout):
                if msg.get("ready"):
                    self.model = msg.get("model", "")
                    self.log(f"ready (model {self.model}, pid {self.proc.pid}"
                             + (f", predd {self.launcher.predd_addr})"
                                if self.name != "openai" else ")"))
                    self.ready.set()
                    continue
                queue = self.waiting.get(msg.get("id"))
                if queue is not None:
                    queue.put_nowait(msg)
        finally:
            await self.proc.wait()
            await asyncio.wait({errors}, timeout=2)

    @staticmethod
    async def _lines(stream: asyncio.StreamReader) -> AsyncIterator[dict]:
        while True:
            line = await stream.readline()
            if not line:
                return
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if isinstance(msg, dict):
                yield msg

    async def _log_stderr(self, stream: asyncio.StreamReader) -> None:
        while True:
            line = await stream.readline()
            if not line:
                return
            self.log(line.decode("utf-8", "replace").rstrip())

    def _fail_waiting(self, message: str) -> None:
        for queue in self.waiting.values():
            queue.put_nowait({"status": 503, "body": ApiError(503, "EIO", message).body()})
            queue.put_nowait({"done": True})

    async def _send(self, msg: dict) -> None:
        if not self.ready.is_set() or self.proc is None or self.proc.stdin.is_closing():
            raise ApiError(503, "EAGAIN", "the OpenAI LIP is not ready; try again")
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())
        await self.proc.stdin.drain()

    def is_ready(self) -> bool:
        return self.ready.is_set()

    def any_ready(self, answering: set[str] | None = None) -> bool:
        """Whether a request can be answered now (the one LIP is ready)."""
        return self.is_ready()

    async def request(self, op: str, body=None, scope: str = "") -> AsyncIterator[dict]:
        """The LIP's reply lines for one request, up to and including `done`. Leaving
        the iteration early (a client that went away) cancels the request."""
        rid = next(self.ids)
        queue: asyncio.Queue = asyncio.Queue()
        self.waiting[rid] = queue
        finished = False
        try:
            await self._send({"id": rid, "op": op, "body": body, "scope": scope})
            while True:
                msg = await queue.get()
                if msg.get("done"):
                    finished = True
                    yield msg
                    return
                yield msg
        finally:
            self.waiting.pop(rid, None)
            if not finished:
                self.log(f"request {rid} cancelled (its client went away)")
                try:
                    await self._send({"id": rid, "op": "cancel"})
                except (ApiError, ConnectionError, RuntimeError):
                    pass

    async def stop(self) -> None:
        """Close its stdin (it exits, and liblip ends its predd session); kill it if it
        does not go within a few seconds."""
        self.closing = True
        self.available.set()          # a suspended loop wakes up to see `closing`
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=5)


class OpenAIBridges:
    """The OpenAI LIPs of every local replica, as one: `bridges[i]` runs on replica i
    (local replicas come first). Each request goes to the replica routes.route picks
    and counts as in flight there until its last reply line."""

    def __init__(self, bridges: list[OpenAIBridge], replicas) -> None:
        self.bridges = bridges
        self.replicas = replicas
        self.routes = PrefixRoutes(len(bridges))
        for i, bridge in enumerate(bridges):
            replicas.on_up.append(lambda k, b=bridge, i=i: b.resume() if k == i else None)
            replicas.on_down.append(lambda k, b=bridge, i=i: b.suspend() if k == i else None)

    def is_ready(self) -> bool:
        return all(b.ready.is_set() for b in self.bridges)

    def any_ready(self, answering: set[str] | None = None) -> bool:
        """Whether a request can be answered now: some replica up (and among the
        addresses `answering`, where given) with its LIP ready."""
        return any(self.replicas.all[i].up and b.ready.is_set()
                   and (answering is None or self.replicas.all[i].addr in answering)
                   for i, b in enumerate(self.bridges))

    async def start(self) -> None:
        await asyncio.gather(*(b.start() for b in self.bridges))

    async def stop(self) -> None:
        await asyncio.gather(*(b.stop() for b in self.bridges), return_exceptions=True)

    def pick(self, op: str, body, scope: str) -> int:
        loads = [self.replicas.all[i].inflight
                 if self.replicas.all[i].up and b.ready.is_set() else None
                 for i, b in enumerate(self.bridges)]
        chosen = self.routes.route(prompt_text(scope, op, body), loads)
        if chosen is None:
            raise ApiError(503, "EAGAIN", "the OpenAI LIP is not ready; try again")
        return chosen

    async def request(self, op: str, body=None, scope: str = "") -> AsyncIterator[dict]:
        index = self.pick(op, body, scope)
        self.replicas.take(index)
        try:
            async for msg in self.bridges[index].request(op, body, scope):
                yield msg
        finally:
            self.replicas.release(index)
