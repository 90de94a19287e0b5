"""Start-up measurements kept per machine, so that every start of predd there makes the
same choices, and so computes the same bits.

predd measures at start-up up to how many rows each kind of projection computes from its
blocks before the dense weight wins (`predd.model.quant_linear.calibrate`). Measured anew at
every start, two starts could choose differently near a limit and sum a row in another
order: a KV cache restored after a restart would then give other logits (~1e-5). So the
first start measures and stores the result in `$SYMPHONY_CACHE/calibration/` (default
`~/.cache/symphony`), under a key of everything the timings depend on (`machine()`: the
CPU's model and flags, the kernel library, torch's version and thread count; the caller
adds the dtype and the projections' shapes and kinds), and later starts read it. Where
the directory cannot be written, or is not this user's alone, the measurement is made at
each start and the start-up line says why. Delete the directory to measure again.

A measurement made while other processes (or, in a VM, the hypervisor: steal time) took
the cores is slower on both paths, unevenly, and may choose another limit than a quiet
machine. `Contention` measures their share of this process's CPUs over the measurement
(/proc/stat); the record keeps it (`others`), and above `LOADED` every start that reads
the record says so, with the file to delete.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from predd.kernels import build, cpu_kernels


LOADED = 0.2     # others' share of the CPUs above which a start-up line warns


def busy_seconds(stat: str, cpus: set[int]) -> float | None:
    """Seconds the CPUs `cpus` spent on anything but idle and I/O wait since boot (steal
    included: the hypervisor gave the time to another), from /proc/stat's text `stat`;
    None where a CPU's line is missing."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy, seen = 0, set()
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        # user nice system idle iowait irq softirq steal (guest is within user)
        busy += sum(fields[:8]) - fields[3] - fields[4]
        seen.add(int(name[3:]))
    return busy / tick if seen == cpus else None


class Contention:
    """Other processes' share of this process's CPUs from its making to `share()`."""

    def __init__(self, stat_path: str = "/proc/stat") -> None:
        self.path = stat_path
        try:
            self.cpus = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            self.cpus = set()
        self.t0, self.own0, self.busy0 = time.monotonic(), time.process_time(), self._busy()

    def _busy(self) -> float | None:
        try:
            with open(self.path) as f:
                return busy_seconds(f.read(), self.cpus) if self.cpus else None
        except OSError:
            return None

    def share(self) -> float | None:
        """(busy time of the CPUs − this process's CPU time) / (wall time × CPUs), in
        [0, 1]; None where /proc/stat cannot say."""
        busy, wall = self._busy(), time.monotonic() - self.t0
        if busy is None or self.busy0 is None or wall <= 0:
            return None
        others = busy - self.busy0 - (time.process_time() - self.own0)
        return min(1.0, max(0.0, others / (wall * len(self.cpus))))


def contended(others: object, stored: bool = True) -> str:
    """The start-up line's warning for a record measured beside others' work (`stored`:
    kept for later starts, which its deletion undoes), else ""."""
    if not isinstance(others, (int, float)) or others <= LOADED:
        return ""
    return (f"other processes had {others:.0%} of the CPUs while it was measured"
            + (": delete the record to measure again on a quiet machine" if stored else ""))


def directory() -> Path:
    return build.cache_dir().parent / "calibration"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What a timing on this machine depends on, besides the model."""
    return {"cpu": cpu_model(), "flags": sorted(build.cpu_flags().split(":", 1)[-1].split()),
            "kernels": cpu_kernels.kernels().path.name, "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def key_of(what: dict) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


def load(key: str) -> tuple[dict | None, str]:
    """(the record stored under `key`, or None; why not where it cannot be used)."""
    where = directory()
    path = where / f"{key}.json"
    try:
        if not build.owned_alone(where):
            return None, f"{where} is not this user's alone"
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {exc}"
    return (record, "") if isinstance(record, dict) else (None, f"{path} is not a record")


def store(key: str, record: dict) -> tuple[dict, str]:
    """Stores `record` under `key` unless a record is there already (two predds measuring
    at once: the first stored wins, and both use it); (the record in force, its path or
    why it was not stored)."""
    where = directory()
    target = where / f"{key}.json"
    record = {**record, "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not build.owned_alone(where):
            return record, f"not stored: {where} is not this user's alone"
        fd, partial = tempfile.mkstemp(suffix=".json", dir=where)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            _place(partial, target)          # whole, and never over another's
        except FileExistsError:
            stored, problem = load(key)
            if stored is not None:
                return stored, str(target)
            return record, f"not stored: {target} is there and {problem or 'unreadable'}"
        finally:
            os.unlink(partial)
    except OSError as exc:
        return record, f"not stored: {where}: {exc.strerror}"
    return record, str(target)


def _place(partial: str, target: Path) -> None:
    """`partial` (written whole) also at `target`; FileExistsError where one is there.
    A hard link where the file system has them, else a copy made with O_EXCL."""
    try:
        os.link(partial, target)
    except FileExistsError:
        raise
    except OSError:
        with open(partial, "rb") as src, open(target, "xb") as dst:
            dst.write(src.read())
