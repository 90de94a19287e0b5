"""The cgroup of one sandboxed run: memory and process limits for the run as a whole,
its CPU time, its OOM kills, and a way to kill all of it.

Works on cgroup v2 (a `symphony-sandbox` group at the root of the unified hierarchy,
one child per run, memory and pids enabled where the kernel offers them), on cgroup v1
(one group per run under the launcher's own group in the `memory`, `pids` and
`cpuacct` hierarchies), and on hybrids (v1 controllers plus a controller-less v2 tree,
used only for CPU accounting and `cgroup.kill`). Each feature comes from the first
hierarchy that provides it and is writable; what none provides stays with the rlimits
(run_limits.py), which are always set. `create` never raises for a host without cgroups:
the features it could not set up are None.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

V2_PARENT = "symphony-sandbox"


@dataclass
class Part:
    path: str
    version: int   # 1 or 2


@dataclass
class Mounts:
    v2: str | None = None                                # unified mount point
    v2_own: str = "/"
    v1: dict[str, str] = field(default_factory=dict)    # controller -> our group's dir


def discover(mountinfo: str = "/proc/self/mountinfo", own: str = "/proc/self/cgroup") -> Mounts:
    """Where each hierarchy is mounted and which group this process is in."""
    groups: dict[str, str] = {}
    with open(own) as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                groups[name] = path
    mounts = Mounts()
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) < 3 or len(fields) < 5:
                continue
            root, point, fstype, options = fields[3], fields[4], rfields[0], rfields[2]
            if fstype == "cgroup2" and mounts.v2 is None:
                mounts.v2, mounts.v2_own = point, groups.get("", "/")
            elif fstype == "cgroup":
                for name in options.split(","):
                    path = groups.get(name)
                    if path is not None and (path + "/").startswith(root.rstrip("/") + "/"):
                        rel = path[len(root.rstrip("/")):].lstrip("/")
                        mounts.v1[name] = os.path.join(point, rel) if rel else point
    return mounts


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_key(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None


def _mkdir(path: str) -> bool:
    try:
        os.mkdir(path, 0o755)
        return True
    except FileExistsError:
        return True
    except OSError:
        return False


class RunCgroup:
    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.memory: Part | None = None
        self.pids: Part | None = None
        self.cpu: Part | None = None

    @classmethod
    def create(cls, name: str, memory: int, max_tasks: int,
               mounts: Mounts | None = None) -> RunCgroup:
        group = cls()
        try:
            mounts = mounts or discover()
        except OSError:
            return group
        if mounts.v2:
            group._make_v2(mounts.v2, name, memory, max_tasks)
        for controller, attr in (("memory", "memory"), ("pids", "pids"), ("cpuacct", "cpu")):
            if getattr(group, attr) is None and controller in mounts.v1:
                part = Part(os.path.join(mounts.v1[controller], name), 1)
                if _mkdir(part.path):
                    group.parts.append(part)
                    setattr(group, attr, part)
        if group.memory and group.memory.version == 1 and not group._limit_v1_memory(memory):
            group.memory = None
        if group.pids and group.pids.version == 1:
            try:
                _write(os.path.join(group.pids.path, "pids.max"), str(max_tasks))
            except OSError:
                group.pids = None
        return group

    def _make_v2(self, mount: str, name: str, memory: int, max_tasks: int) -> None:
        parent = os.path.join(mount, V2_PARENT)
        if not _mkdir(parent):
            return
        for controller in ("memory", "pids"):
            for where in (mount, parent):   # the root's subtree first, then ours
                try:
                    _write(os.path.join(where, "cgroup.subtree_control"), f"+{controller}")
                except OSError:   # not offered (bound to v1), or a busy group
                    break
        try:
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                wanted = f.read().split()
        except OSError:
            wanted = []
        part = Part(os.path.join(parent, name), 2)
        if not _mkdir(part.path):
            return
        self.parts.append(part)
        self.cpu = part   # cpu.stat exists in every v2 group
        if "memory" in wanted:
            try:
                _write(os.path.join(part.path, "memory.max"), str(memory))
                self.memory = part
                _write(os.path.join(part.path, "memory.swap.max"), "0")
            except OSError:
                pass
        if "pids" in wanted:
            try:
                _write(os.path.join(part.path, "pids.max"), str(max_tasks))
                self.pids = part
            except OSError:
                pass

    def _limit_v1_memory(self, memory: int) -> bool:
        try:
            _write(os.path.join(self.memory.path, "memory.limit_in_bytes"), str(memory))
        except OSError:
            return False
        try:   # memory + swap: absent when swap accounting is off
            _write(os.path.join(self.memory.path, "memory.memsw.limit_in_bytes"), str(memory))
        except OSError:
            pass
        return True

    # ---------------------------------------------------------------- the run

    def attach(self, pid: int) -> None:
        for part in self.parts:
            _write(os.path.join(part.path, "cgroup.procs"), str(pid))

    def cpu_seconds(self) -> float | None:
        if self.cpu is None:
            return None
        if self.cpu.version == 2:
            usec = _read_key(os.path.join(self.cpu.path, "cpu.stat"), "usage_usec")
            return None if usec is None else usec / 1e6
        try:
            with open(os.path.join(self.cpu.path, "cpuacct.usage")) as f:
                return int(f.read()) / 1e9
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        if self.memory is None:
            return 0
        name = "memory.events" if self.memory.version == 2 else "memory.oom_control"
        return _read_key(os.path.join(self.memory.path, name), "oom_kill") or 0

    def pids_in(self) -> list[int]:
        out: set[int] = set()
        for part in self.parts:
            try:
                with open(os.path.join(part.path, "cgroup.procs")) as f:
                    out.update(int(x) for x in f.read().split())
            except OSError:
                pass
        return sorted(out)

    def kill(self) -> None:
        """SIGKILL every process of the run (cgroup.kill where the kernel has it)."""
        for part in self.parts:
            if part.version == 2 and os.path.exists(os.path.join(part.path, "cgroup.kill")):
                try:
                    _write(os.path.join(part.path, "cgroup.kill"), "1")
                except OSError:
                    pass
        for _ in range(100):
            pids = self.pids_in()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def remove(self) -> list[str]:
        """Remove the run's groups; the paths that would not go (normally none)."""
        left = []
        for part in self.parts:
            for attempt in range(250):   # busy for a moment after its last task left
                try:
                    os.rmdir(part.path)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt % 50 == 49:
                        self.kill()
                    time.sleep(0.02)
            else:
                left.append(part.path)
        self.parts.clear()
        return left
