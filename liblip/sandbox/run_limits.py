"""The resource limits of one sandboxed run, and the rlimits that back them.

`Limits` is what `lip run --sandbox` is given (memory, CPU seconds, wall seconds,
processes). The cgroup of the run (cgroups.py) enforces memory, processes and CPU time
for the run as a whole where the host lets us; the rlimits below are set in every case,
per process, so no run is ever unlimited:
  RLIMIT_AS     = memory        (a single allocation beyond it fails: ENOMEM)
  RLIMIT_CPU    = cpu seconds   (SIGXCPU, then SIGKILL one second later)
  RLIMIT_NPROC  = max procs     (counted per uid: the run's uid is fresh)
  RLIMIT_FSIZE  = memory, RLIMIT_NOFILE = 1024, RLIMIT_CORE = 0.
"""
from __future__ import annotations

import re
import resource
from dataclasses import dataclass

DEFAULT_MEMORY = 2 << 30
DEFAULT_CPU_SECONDS = 600
DEFAULT_WALL_SECONDS = 3600
DEFAULT_MAX_PROCS = 64
MIN_MEMORY = 32 << 20
OPEN_FILES = 1024

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'512M', '2G', '2GiB', '1048576' -> bytes (binary units). ValueError otherwise."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, M, G or T)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_size(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit] and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return f"{n}"


@dataclass(frozen=True)
class Limits:
    memory: int = DEFAULT_MEMORY
    cpu_seconds: int = DEFAULT_CPU_SECONDS
    wall_seconds: int = DEFAULT_WALL_SECONDS
    max_procs: int = DEFAULT_MAX_PROCS

    def problems(self) -> list[str]:
        """What is wrong with these limits (empty when they can be applied)."""
        out = []
        if self.memory < MIN_MEMORY:
            out.append(f"memory {self.memory} is below {format_size(MIN_MEMORY)}")
        for name in ("cpu_seconds", "wall_seconds", "max_procs"):
            if getattr(self, name) < 1:
                out.append(f"{name.replace('_', '-')} must be >= 1")
        return out

    def rlimits(self) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) for a process of the run."""
        return [(resource.RLIMIT_AS, self.memory, self.memory),
                (resource.RLIMIT_CPU, self.cpu_seconds, self.cpu_seconds + 1),
                (resource.RLIMIT_NPROC, self.max_procs, self.max_procs),
                (resource.RLIMIT_FSIZE, self.memory, self.memory),
                (resource.RLIMIT_NOFILE, OPEN_FILES, OPEN_FILES),
                (resource.RLIMIT_CORE, 0, 0)]

    def apply_rlimits(self) -> None:
        for which, soft, hard in self.rlimits():
            resource.setrlimit(which, (soft, hard))
