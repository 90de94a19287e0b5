"""Program runs: a sandboxed process per run, its output as a list of events.

Lifetime rules:
* A run is `starting` until its process exists, then `running`; it ends `exited` (the
  program's own exit), `killed` (DELETE, its client went away, a limit) or `failed`
  (it could not be started). Its events are `run` (first: id and program), `stdout`
  and `stderr` (one per line), and exactly one `exit`, the last, sent only after predd
  has ended the run's sessions (meter.settle), so its anonymous KV objects are free.
* Every process of a run shares one process group (the launcher starts a new session),
  and killing a run sends SIGINT to its programs (a Python LIP unwinds, and liblip ends
  its predd session at exit), then SIGKILL to the whole group after KILL_GRACE_S.
* A run is its caller's: other callers get 404 for it. Finished runs are kept (state
  and output) until KEEP_FINISHED newer ones have finished.
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
from gatewayd.meter import Meter
from gatewayd.metrics import Metrics
from gatewayd.programs import Program, remove_upload

ACTIVE = ("starting", "running")
KILL_GRACE_S = 2.0
KEEP_FINISHED = 256
MAX_EVENTS = 20000          # kept per run for replay; older ones are dropped
MAX_LINE = 64 * 1024
MAX_ARGS, MAX_ARG_LEN, MAX_STDIN = 64, 4096, 1 << 20


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


class Runs:
    def __init__(self, launcher: Launcher, meter: Meter, metrics: Metrics, log) -> None:
        self.launcher = launcher
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
                    run_id: str | None = None) -> Run:
        """Check the request and the caller's limits, then start the process."""
        try:
            args, stdin = _args(list(args) if isinstance(args, (list, tuple)) else args, stdin)
            extra = check_env(env or {})
            if self.closing:
                raise ApiError(503, "ESHUTDOWN", "the server is stopping")
            limits = caller.limits
            if sum(r.active for r in self.of(caller)) >= limits.runs:
                raise ApiError(429, "EAGAIN", f"{caller.name} already has {limits.runs} runs "
                               "going (the limit for this key)")
            if limits.pages:   # predd's figure for the uid, or what its runs hold
                held = max(await self.meter.uid_pages(caller.uid),
                           sum(self.meter.pages(r.id) for r in self.of(caller) if r.active))
                if held >= limits.pages:
                    raise ApiError(429, "EDQUOT", f"uid {caller.uid} holds {held} KV pages; "
                                   f"this key may start runs below {limits.pages}")
        except ApiError:
            if upload_dir:
                remove_upload(upload_dir)
            raise
        run = Run(run_id or "run_" + secrets.token_hex(8), program, caller, detached,
                  interactive, upload_dir)
        self.runs[run.id] = run
        self.metrics.run_started(program.name)
        await run.emit("run", json.dumps({"id": run.id, "program": program.name}))
        argv = self.launcher.argv(program, args, caller.uid, limits.wall)
        try:
            run.proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, cwd="/", start_new_session=True,
                env=self.launcher.env(program, extra, run.id))
        except OSError as exc:
            run.state, run.reason = "failed", f"cannot start: {exc.strerror}"
            await self._end(run, settle=False)
            raise ApiError(500, "EIO", f"{program.name}: {run.reason}") from None
        run.state = "running"
        self.log(f"run {run.id}: {program.name} for {caller.name} (uid {caller.uid}) "
                 f"pid {run.proc.pid}")
        await self.meter.track(run.id, run.proc.pid)
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
        # Its processes get the grace period to finish (liblip says `bye` as Python
        # unwinds from SIGINT); whatever is left then, or kept our pipes open after a
        # normal exit, is killed.
        await self._reap(proc.pid, KILL_GRACE_S if run.kill_reason else 0.0)
        await asyncio.wait(pumps, timeout=5)
        code = proc.returncode
        run.exit_status = 128 - code if code < 0 else code
        if run.kill_reason:
            run.state, run.reason = "killed", run.kill_reason
        else:
            run.state = "exited"
        await self._end(run, settle=True)

    async def _pump(self, run: Run, stream: asyncio.StreamReader, kind: str) -> None:
        pending = b""
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                break
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                await run.emit(kind, line[:MAX_LINE].decode("utf-8", "replace"))
            if len(pending) > MAX_LINE:
                await run.emit(kind, pending[:MAX_LINE].decode("utf-8", "replace"))
                pending = b""
        if pending:
            await run.emit(kind, pending[:MAX_LINE].decode("utf-8", "replace"))

    async def _end(self, run: Run, settle: bool) -> None:
        ended = time.time()
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

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> bool:
        """Signal the run's process group; False when it has no process left."""
        try:
            os.killpg(pgid, sig)
            return True
        except ProcessLookupError:
            return False

    @staticmethod
    def _group(pgid: int) -> list[int]:
        """The group's processes that still run (a zombie, whose parent has not reaped
        it yet, has finished)."""
        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != b"Z":
                pids.append(int(name))
        return pids

    def _group_running(self, pgid: int) -> bool:
        return bool(self._group(pgid))

    async def _reap(self, pgid: int, grace: float) -> None:
        """Wait up to `grace` for the group to finish, then SIGKILL what is left."""
        deadline = time.monotonic() + grace
        while self._group_running(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 2.0
        while self._group_running(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def kill(self, run: Run, reason: str, wait: bool = True) -> None:
        """Stop a run: SIGINT to its programs (Python unwinds and liblip ends its predd
        session), SIGKILL to its whole process group after KILL_GRACE_S. With `wait`, return once it has
        ended and predd has freed its sessions' objects."""
        if run.active and run.proc is not None and run.kill_reason is None:
            run.kill_reason = reason
            # The program, not its launcher: `lip run` then reports the program's end.
            launcher = run.proc.pid
            programs = [p for p in self._group(launcher) if p != launcher] or [launcher]
            for pid in programs:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
            asyncio.create_task(self._reap(launcher, KILL_GRACE_S))
        if wait:
            await run.done.wait()

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
