"""What a run costs, read off predd's public figures (`ps`, `stats`) — never its insides.

A run's predd sessions are the sessions whose (kernel-reported) pid belongs to the run's
process tree: the sandbox launcher and its descendants, rescanned from /proc at every
poll (every `interval` seconds while any run is alive; see `_owns`). From them:
* `peak_pages`: the most KV pages the run's sessions held at once (sampled per poll,
  and once more as a run is killed);
* `sessions`: how many predd sessions the run opened (that the polls saw);
* `settle(run)`: after the processes are gone, wait until predd has ended every one of
  those sessions — at once when the program said `bye` (liblip does at exit), else
  when its lease runs out — so a run's anonymous KV objects are free when it reports
  its exit.
* `tokens_computed`/`tokens_reused`: the sum over the run's sessions of what predd
  counted for each (`ps` rows; an ended session's final figures stay in `ps.ended` a
  while), so a run's cost is its own even when other runs share predd. Against a predd
  without per-session figures it falls back to the difference of predd-wide counters
  over the run's lifetime, and `tokens_exclusive` says whether nothing else ran then.

With replicas, a run's sessions are on the predd it was placed on (`track(addr=...)`):
every figure of the run is read from that replica alone.
"""
from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import liblip as lip


class ProcessPredd:
    """The process's one predd connection, for a gateway without replicas (and tests)."""

    live_addrs: list[str] = []

    def call(self, addr: str, op: str, timeout: float | None = 5.0, **fields) -> dict:
        return lip.client().call(op, timeout=timeout, **fields)


@dataclass
class Usage:
    root_pid: int
    uid: int
    started: float
    stats0: dict
    addr: str = ""
    pids: set[int] = field(default_factory=set)
    ns_pids: set[int] = field(default_factory=set)
    sessions: set[int] = field(default_factory=set)     # predd session ids seen
    pages: int = 0
    peak_pages: int = 0
    shared: bool = False
    alive: bool = True
    cost: dict = field(default_factory=dict)


def processes() -> tuple[dict[int, list[int]], set[int]]:
    """From /proc: ppid -> pids, and the pids that have finished (zombies)."""
    tree: dict[int, list[int]] = {}
    zombies: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        tree.setdefault(int(fields[1]), []).append(int(name))
        if fields[0] == b"Z":
            zombies.add(int(name))
    return tree, zombies


def descendants(root: int, tree: dict[int, list[int]]) -> set[int]:
    out, todo = {root}, [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def running_descendants(root: int) -> set[int]:
    """The processes under `root` (not itself) that still run."""
    tree, zombies = processes()
    return descendants(root, tree) - {root} - zombies


def namespace_pid(pid: int) -> int | None:
    """A process's pid in its own (innermost) pid namespace: a sandboxed program's
    os.getpid()."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return None


class Meter:
    def __init__(self, interval: float = 0.2, lease_s: float = 10.0, predds=None) -> None:
        self.predds = predds or ProcessPredd()   # .call(addr, op, ...), .live_addrs
        self.interval = interval
        self.lease_s = lease_s
        self.usage: dict[str, Usage] = {}
        self.activities: set[str] = set()     # runs and OpenAI requests in progress
        self._wake = asyncio.Event()

    # ------------------------------------------------------------ activity

    def _begin(self, key: str) -> None:
        self.activities.add(key)
        if len(self.activities) > 1:
            for other in self.activities:
                if other in self.usage:
                    self.usage[other].shared = True

    def begin_request(self, key: str) -> None:
        """An OpenAI request (or other predd work the gateway causes) started."""
        self._begin(key)

    def end_request(self, key: str) -> None:
        self.activities.discard(key)

    def _call(self, addr: str, op: str) -> dict:
        return self.predds.call(addr, op)

    def _ps(self, addr: str) -> list[dict]:
        return self._call(addr, "ps")["sessions"]

    async def track(self, run_id: str, root_pid: int, uid: int, addr: str = "") -> None:
        try:
            stats0 = await asyncio.to_thread(self._call, addr, "stats")
        except lip.LipError:
            stats0 = {"tokens_computed": 0, "tokens_reused": 0}
        self.usage[run_id] = Usage(root_pid, uid, time.monotonic(), stats0, addr,
                                   pids={root_pid})
        self._begin(run_id)
        self._wake.set()

    # ------------------------------------------------------------ polling

    async def loop(self) -> None:
        while True:
            if not any(u.alive for u in self.usage.values()):
                self._wake.clear()
                await self._wake.wait()
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.interval)

    def poll(self) -> None:
        """One look at the sessions of every predd a live run is on; updates every
        live run's usage."""
        rows_of: dict[str, list[dict]] = {}
        for addr in {u.addr for u in self.usage.values() if u.alive}:
            try:
                rows_of[addr] = self._ps(addr)
            except lip.LipError:
                pass
        tree, _ = processes()
        for u in self.usage.values():
            if u.addr not in rows_of:
                continue
            rows = rows_of[u.addr]
            if u.alive:
                new = descendants(u.root_pid, tree) - u.pids
                u.pids |= new
                u.ns_pids |= {n for n in map(namespace_pid, new) if n is not None}
            mine = [r for r in rows if self._owns(u, r)]
            if u.alive:
                u.sessions |= {r["session"] for r in mine}
                u.pages = sum(r.get("pages", 0) for r in mine)
                u.peak_pages = max(u.peak_pages, u.pages)

    def sample(self) -> None:
        """`poll`, where predd's errors leave the figures as they were: every interval,
        and as a run is killed (what it holds then counts in its peak)."""
        try:
            self.poll()
        except lip.LipError:
            pass

    @staticmethod
    def _owns(u: Usage, row: dict) -> bool:
        """Whether a `ps` row is one of the run's sessions: its pid (the kernel's, as
        predd reads it from SO_PEERCRED) is in the run's tree. A predd that shows the
        pid a client declared shows the one inside the sandbox's pid namespace; then
        the uid must match as well (runs of one uid can then not be told apart)."""
        pid = row.get("pid")
        return pid in u.pids or (row.get("uid") == u.uid and pid in u.ns_pids)

    async def settle(self, run_id: str) -> bool:
        """The run's processes are gone: wait until predd has ended its sessions
        (at most a lease and a bit). True when they all ended."""
        u = self.usage[run_id]
        u.alive = False
        self.activities.discard(run_id)
        deadline = time.monotonic() + self.lease_s + 2.0
        while True:
            try:
                rows = await asyncio.to_thread(self._ps, u.addr)
            except lip.LipError:
                return False
            live = {r["session"] for r in rows} & u.sessions | {
                r["session"] for r in rows if self._owns(u, r)}
            if not live:
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)

    async def finish(self, run_id: str, wall_s: float) -> dict:
        """The run's cost, once it has settled; forgets the run."""
        u = self.usage.pop(run_id)
        try:
            ps = await asyncio.to_thread(self._call, u.addr, "ps")
        except lip.LipError:
            ps = {}
        if "ended" in ps:   # per-session figures: the run's own, exactly
            mine = [r for r in ps["sessions"] + ps["ended"]
                    if r["session"] in u.sessions or self._owns(u, r)]
            u.sessions |= {r["session"] for r in mine}
            computed = sum(r["tokens_computed"] for r in mine)
            reused = sum(r["tokens_reused"] for r in mine)
            exclusive = True
        else:
            try:
                stats1 = await asyncio.to_thread(self._call, u.addr, "stats")
            except lip.LipError:
                stats1 = u.stats0
            computed = stats1["tokens_computed"] - u.stats0["tokens_computed"]
            reused = stats1["tokens_reused"] - u.stats0["tokens_reused"]
            exclusive = not u.shared
        return {
            "tokens_computed": computed,
            "tokens_reused": reused,
            "tokens_exclusive": exclusive,
            "peak_pages": u.peak_pages,
            "sessions": len(u.sessions),
            "wall_s": round(wall_s, 3),
        }

    def live_cost(self, run_id: str, wall_s: float) -> dict:
        u = self.usage.get(run_id)
        if u is None:
            return {}
        return {"pages": u.pages, "peak_pages": u.peak_pages, "sessions": len(u.sessions),
                "wall_s": round(wall_s, 3)}

    def pages(self, run_id: str) -> int:
        """KV pages a live run's sessions held at the last poll."""
        u = self.usage.get(run_id)
        return u.pages if u is not None else 0

    async def uid_pages(self, uid: int) -> int:
        """KV pages `uid` holds now, summed over the replicas that answer: predd's per-uid
        figure where `ps` has one (persistent caches included), else the sum over its
        sessions."""
        total = 0
        for addr in list(self.predds.live_addrs) or [""]:
            try:
                reply = await asyncio.to_thread(self._call, addr, "ps")
            except lip.LipError:
                continue
            rows = [r for r in reply.get("uids", []) if r.get("uid") == uid]
            if rows:
                total += int(rows[0].get("pages", 0))
            else:
                total += sum(r.get("pages", 0) for r in reply.get("sessions", [])
                             if r.get("uid") == uid)
        return total
