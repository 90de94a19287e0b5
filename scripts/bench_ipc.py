"""A round trip between two Python processes, each blocking while it waits: a Unix stream
socket (`send`, `recv`) against shared memory with an eventfd each way
(`eventfd_write`, a blocking `eventfd_read`). A 100-byte request, a 60-byte reply; wall
time and each side's CPU (user + system) a round trip (docs/kernels.md, "A shared-memory
ring instead of the stream: measured, not built").

    python scripts/bench_ipc.py [--round-trips 20000] [--repeat 2]
"""
from __future__ import annotations

import argparse
import mmap
import os
import resource
import socket
import time

REQUEST, REPLY = b"q" * 100, b"r" * 60


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def stream(n: int) -> tuple[float, float, float]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return _measure(n, lambda: (ours.send(REQUEST), ours.recv(4096)),
                    lambda: (theirs.recv(4096), theirs.send(REPLY)))


def ring(n: int) -> tuple[float, float, float]:
    shm = mmap.mmap(-1, 4096)
    asked, answered = os.eventfd(0), os.eventfd(0)

    def call() -> None:
        shm[8:8 + len(REQUEST)] = REQUEST
        os.eventfd_write(asked, 1)
        os.eventfd_read(answered)
        _ = shm[200:200 + len(REPLY)]

    def serve() -> None:
        os.eventfd_read(asked)
        _ = shm[8:8 + len(REQUEST)]
        shm[200:200 + len(REPLY)] = REPLY
        os.eventfd_write(answered, 1)
    return _measure(n, call, serve)


def _measure(n: int, call, serve) -> tuple[float, float, float]:
    """(wall, caller's CPU, server's CPU) a round trip, in seconds."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        started = cpu_s()
        for _ in range(n):
            serve()
        os.write(write_end, repr(cpu_s() - started).encode())
        os._exit(0)
    t0, c0 = time.perf_counter(), cpu_s()
    for _ in range(n):
        call()
    wall, ours = time.perf_counter() - t0, cpu_s() - c0
    os.waitpid(pid, 0)
    theirs = float(os.read(read_end, 64))
    os.close(read_end)
    os.close(write_end)
    return wall / n, ours / n, theirs / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--round-trips", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    for _ in range(args.repeat):
        for name, run in (("unix stream", stream), ("shared memory + eventfd", ring)):
            wall, ours, theirs = run(args.round_trips)
            print(f"{name:24s} wall {wall * 1e6:6.1f} us, CPU a round trip: caller "
                  f"{ours * 1e6:5.1f} us, server {theirs * 1e6:5.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
