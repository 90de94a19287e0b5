"""Program runs: a sandboxed process per run, its output as a list of events.

Lifetime rules:
* A run is `starting` until its process exists, then `running`; it ends `exited` (the
  program's own exit), `killed` (DELETE, its client went away, a limit) or `failed`
  (it could not be started). Its events are `run` (first: id and program), `stdout`
  and `stderr` (one per line), and exactly one `exit`, the last, sent only after predd
  has ended the run's sessions (meter.settle), so its anonymous KV objects are free.
* A run is one `lip run --sandbox` launcher and what runs under it (the sandbox's own
  pid namespace: when the program ends, everything of the run ends). Killing a run
  sends SIGINT to the processes under the launcher (a Python LIP unwinds, and liblip
  ends its predd session at exit), then SIGTERM to the launcher after KILL_GRACE_S.
* A run is its caller's: other callers get 404 for it. Finished runs are kept (state
  and output) until KEEP_FINISHED newer ones have finished.
* With replicas, a run is placed when it starts (placement.py: the replica whose copies
  of its `near` files hold the most tokens, under the load cap), runs there (its
  PREDD_ADDR) and counts as in flight there until it ends.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gatewayd.errors import ApiError
from gatewayd.keys import Caller
from gatewayd.launcher import Launcher, check_env
from gatewayd.meter import Meter, running_descendants
from gatewayd.metrics import Metrics
from gatewayd.placement import choose
from gatewayd.programs import Program, remove_upload
from gatewayd.replicas import near_holdings

ACTIVE = ("starting", "running")
KILL_GRACE_S = 5.0
KEEP_FINISHED = 256
MAX_EVENTS = 20000          # kept per run for replay; older ones are dropped
MAX_LINE = 64 * 1024
MAX_ARGS, MAX_ARG_LEN, MAX_STDIN = 64, 4096, 1 << 20
MAX_NEAR = 64


@dataclass
class RunEvent:
    seq: int
    kind: str        # run | stdout | stderr | exit
    data: str


@dataclass
class Run:
    id: str
    program: Program
    caller: Caller
    detached: bool
    interactive: bool
    upload_dir: str | None = None
    state: str = "starting"
    exit_status: int | None = None
    reason: str = ""                   # why it was killed, or failed
    created: float = field(default_factory=time.time)
    started_mono: float = field(default_factory=time.monotonic)
    ended: float | None = None
    cost: dict = field(default_factory=dict)
    events: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MAX_EVENTS))
    seq: int = 0
    proc: asyncio.subprocess.Process | None = None
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    kill_reason: str | None = None
    sandbox_note: str = ""
    replica: str = ""                  # the predd address it runs on
    replica_index: int | None = None   # counted in flight there until it ends

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def wall_s(self) -> float:
        end = self.ended if self.ended is not None else time.time()
        return end - self.created

    def public(self, meter: Meter | None = None) -> dict:
        cost = self.cost or (meter.live_cost(self.id, self.wall_s()) if meter else {})
        return {"id": self.id, "object": "run", "program": self.program.name,
                "owner": self.caller.name, "uid": self.caller.uid, "state": self.state,
                "exit_status": self.exit_status, "reason": self.reason or None,
                "detached": self.detached, "interactive": self.interactive,
                "replica": self.replica,
                "created": round(self.created, 3),
                "ended": round(self.ended, 3) if self.ended else None, "cost": cost}

    async def emit(self, kind: str, data: str) -> None:
        async with self.changed:
            self.seq += 1
            self.events.append(RunEvent(self.seq, kind, data))
            self.changed.notify_all()

    async def follow(self, after: int = 0) -> AsyncIterator[RunEvent]:
        """Its events with seq > `after` (those still kept), then new ones as they come,
        up to and including `exit`."""
        while True:
            async with self.changed:
                await self.changed.wait_for(lambda: self.seq > after)
                batch = [e for e in self.events if e.seq > after]
            for event in batch:
                after = event.seq
                yield event
                if event.kind == "exit":
                    return


def _args(args, stdin) -> tuple[list[str], str]:
    if not isinstance(args, list) or len(args) > MAX_ARGS or not all(
            isinstance(a, str) and len(a) <= MAX_ARG_LEN and "\0" not in a for a in args):
        raise ApiError(400, "EINVAL", f"args is a list of at most {MAX_ARGS} strings of at "
                       f"most {MAX_ARG_LEN} characters", "args")
    if not isinstance(stdin, str) or len(stdin.encode()) > MAX_STDIN:
        raise ApiError(400, "EINVAL", f"stdin is a string of at most {MAX_STDIN} bytes",
                       "stdin")
    return args, stdin


def _near(near) -> list[str]:
    if near is None:
        return []
    if not isinstance(near, list) or len(near) > MAX_NEAR or not all(
            isinstance(p, str) and 0 < len(p) <= MAX_ARG_LEN and "\0" not in p for p in near):
        raise ApiError(400, "EINVAL", f"near is a list of at most {MAX_NEAR} paths (strings, "
                       "relative to the mount or absolute inside it)", "near")
    return near


class Runs:
    def __init__(self, launcher: Launcher, meter: Meter, metrics: Metrics, log,
                 replicas=None) -> None:
        self.launcher = launcher
        self.replicas = replicas      # gatewayd.replicas.Replicas; None: launcher's predd
        self.meter = meter
        self.metrics = metrics
        self.log = log
        self.runs: dict[str, Run] = {}
        self.finished: collections.deque[str] = collections.deque()
        self.closing = False

    def get(self, run_id: str, caller: Caller) -> Run:
        run = self.runs.get(run_id)
        if run is None or run.caller != caller:
            raise ApiError(404, "ENOENT", f"no run {run_id!r}", "id")
        return run

    def of(self, caller: Caller) -> list[Run]:
        return [r for r in self.runs.values() if r.caller == caller]

    async def start(self, program: Program, caller: Caller, args=(), stdin: str = "",
                    env: dict | None = None, detached: bool = False,
                    interactive: bool = False, upload_dir: str | None = None,
                    run_id: str | None = None, near=None) -> Run:
        """Check the request and the caller's limits, place it, then start the process."""
        try:
            args, stdin = _args(list(args) if isinstance(args, (list, tuple)) else args, stdin)
            extra = check_env(env or {})
            near = _near(near)
            near_tokens = None
            if self.replicas is not None:
                near_tokens = await asyncio.to_thread(near_holdings, self.launcher.mount, near,
                                               self.replicas.addrs)
            if self.closing:
                raise ApiError(503, "ESHUTDOWN", "the server is stopping")
            limits = caller.limits
            if limits.pages:   # predd's figure for the uid, or what its runs hold
                held = max(await self.meter.uid_pages(caller.uid),
                           sum(self.meter.pages(r.id) for r in self.of(caller) if r.active))
                if held >= limits.pages:
                    raise ApiError(429, "EDQUOT", f"uid {caller.uid} holds {held} KV pages; "
                                   f"this key may start runs below {limits.pages}")
            # counted and taken with no await in between: concurrent starts cannot both fit
            if sum(r.active for r in self.of(caller)) >= limits.runs:
                raise ApiError(429, "EAGAIN", f"{caller.name} already has {limits.runs} runs "
                               "going (the limit for this key)")
            index, addr = None, self.launcher.predd_addr
            if self.replicas is not None:
                index = choose(self.replicas.loads(), near_tokens)
                if index is None:
                    raise ApiError(503, "EIO", "no predd replica is up; try again")
                addr = self.replicas.all[index].addr
                self.replicas.take(index)
        except ApiError:
            if upload_dir:
                remove_upload(upload_dir)
            raise
        run = Run(run_id or "run_" + secrets.token_hex(8), program, caller, detached,
                  interactive, upload_dir, replica=addr, replica_index=index)
        self.runs[run.id] = run
        self.metrics.run_started(program.name)
        await run.emit("run", json.dumps({"id": run.id, "program": program.name,
                                          "replica": addr}))
        launcher = self.launcher.on(addr)
        argv = launcher.argv(program, args, caller.uid, limits.wall)
        try:
            run.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd="/", start_new_session=True,
                env=launcher.env(program, extra, run.id))
        except OSError as exc:
            await self._end(run, "failed", f"cannot start: {exc.strerror}", settle=False)
            raise ApiError(500, "EIO", f"{program.name}: {run.reason}") from None
        run.state = "running"
        self.log(f"run {run.id}: {program.name} for {caller.name} (uid {caller.uid}) "
                 f"pid {run.proc.pid}" + (f" on {addr}" if self.replicas is not None
                                          and len(self.replicas.all) > 1 else ""))
        await self.meter.track(run.id, run.proc.pid, caller.uid, addr)
        asyncio.create_task(self._supervise(run, stdin, limits.wall))
        return run

    async def _supervise(self, run: Run, stdin: str, wall_s: float) -> None:
        proc = run.proc
        pumps = [asyncio.create_task(self._pump(run, proc.stdout, "stdout")),
                 asyncio.create_task(self._pump(run, proc.stderr, "stderr"))]
        if stdin:
            try:
                proc.stdin.write(stdin.encode())
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
        if not run.interactive:
            proc.stdin.close()
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), wall_s)
        except asyncio.TimeoutError:
            await self.kill(run, f"ETIME: wall time limit ({wall_s:g} s) reached", wait=False)
            await proc.wait()
        await asyncio.wait(pumps, timeout=5)   # the sandbox ended every process of the run
        code = proc.returncode
        run.exit_status = 128 - code if code < 0 else code
        if run.kill_reason:
            await self._end(run, "killed", run.kill_reason, settle=True)
        else:
            await self._end(run, "exited", run.sandbox_note, settle=True)

    async def _pump(self, run: Run, stream: asyncio.StreamReader, kind: str) -> None:
        pending = b""
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                text = line[:MAX_LINE].decode("utf-8", "replace")
                if kind == "stderr" and text.startswith("lip: E") and ": sandbox: " in text:
                    run.sandbox_note = text[len("lip: "):]    # why the sandbox ended it
                await run.emit(kind, text)
            if len(pending) > MAX_LINE:
                await run.emit(kind, pending[:MAX_LINE].decode("utf-8", "replace"))
                pending = b""
        if pending:
            await run.emit(kind, pending[:MAX_LINE].decode("utf-8", "replace"))

    async def _end(self, run: Run, state: str, reason: str, settle: bool) -> None:
        """The run's processes are gone: once predd has ended its sessions, it takes its
        final state and sends `exit` (so whoever sees either sees its pages free)."""
        ended = time.time()
        if run.replica_index is not None and self.replicas is not None:
            self.replicas.release(run.replica_index)
            run.replica_index = None
        if settle:
            settled = await self.meter.settle(run.id)
            run.ended = time.time()
            run.cost = await self.meter.finish(run.id, ended - run.created)
            run.cost["sessions_ended"] = settled
        else:
            run.ended = ended
            run.cost = {"wall_s": round(ended - run.created, 3)}
        if run.upload_dir:
            remove_upload(run.upload_dir)
        run.state, run.reason = state, reason
        ok = run.state == "exited" and run.exit_status == 0
        self.metrics.run_ended(run.program.name, ok)
        await run.emit("exit", json.dumps({"status": run.exit_status, "state": run.state,
                                           "reason": run.reason or None, "cost": run.cost}))
        run.done.set()
        self.log(f"run {run.id}: {run.state} status {run.exit_status}"
                 + (f" ({run.reason})" if run.reason else ""))
        self.finished.append(run.id)
        while len(self.finished) > KEEP_FINISHED:
            self.runs.pop(self.finished.popleft(), None)

    async def kill(self, run: Run, reason: str, wait: bool = True) -> None:
        """Stop a run: SIGINT to its processes (a Python LIP unwinds and liblip ends its
        predd session), then the sandbox launcher ends what is left (SIGTERM after
        KILL_GRACE_S: it kills the run's pid namespace). With `wait`, return once the
        run has ended and predd has freed its sessions' objects."""
        if run.active and run.proc is not None and run.kill_reason is None:
            run.kill_reason = reason
            # what it holds now counts in its peak, whenever the last poll was
            await asyncio.to_thread(self.meter.sample)
            inside = running_descendants(run.proc.pid)
            for pid in inside:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
            if not inside:                 # not started yet: the launcher ends the run
                with contextlib.suppress(ProcessLookupError):
                    run.proc.send_signal(signal.SIGTERM)
            asyncio.create_task(self._escalate(run.proc))
        if wait:
            await run.done.wait()

    @staticmethod
    async def _escalate(proc: asyncio.subprocess.Process) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_GRACE_S)
                return
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    if sig == signal.SIGKILL:   # the launcher does not answer: everything
                        for pid in running_descendants(proc.pid):
                            os.kill(pid, sig)
                    proc.send_signal(sig)

    async def write_input(self, run: Run, data: str | None, eof: bool) -> None:
        if not run.active or run.proc is None:
            raise ApiError(409, "EPIPE", f"run {run.id} has ended")
        if not run.interactive or run.proc.stdin.is_closing():
            raise ApiError(409, "EPIPE", f"run {run.id} takes no input (start it with "
                           "\"interactive\": true)")
        try:
            if data is not None:
                run.proc.stdin.write((data if data.endswith("\n") else data + "\n").encode())
                await run.proc.stdin.drain()
            if eof:
                run.proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            raise ApiError(409, "EPIPE", f"run {run.id} closed its input") from None

    async def shutdown(self) -> None:
        self.closing = True
        active = [r for r in self.runs.values() if r.active]
        await asyncio.gather(*(self.kill(r, "ESHUTDOWN: the server is stopping")
                               for r in active), return_exceptions=True)
