"""kvfs at scale: what one namespace operation costs in a directory of N files against
one of 10, and how long `ls` of the N takes.

    python scripts/bench_kvfs_scale.py [--files N] [--ops K] [--workers W]

Starts a predd (the default model) and a kvfsd on a temporary mount and state
directory. For each size S in (10, N): a directory of S empty cache files (made by W
concurrent creators: open(O_CREAT) and close, one `kv_create` each; empty caches take
no KV pages), then K timed rounds in that directory of what the shell does:

* touch — open(O_CREAT | O_EXCL) and close: a new empty cache;
* cp — what coreutils cp does: read a 20-token file's descriptor, write it into a new
  file, close (a fork);
* mv — rename within the directory;
* rm — unlink (the fork's cache is freed);
* stat — lstat of an existing file.

Then `ls` (coreutils, one getdents stream) and `ls -l` (a stat and a kv_stat per file)
of the big directory. Prints `RESULT {...}` lines: per-op medians at 10 and at N and
their ratio (`ratio` = at N / at 10; 1.0 means the size costs nothing), and the `ls`
times. The baseline, 10 files, is measured in the same run. Syscalls are made from
this process, so process start-up (a few ms per coreutils command) does not hide the
file system's own cost.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OPS = ("touch", "cp", "mv", "rm", "stat")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def start_kvfsd(addr: str, mount: str, state: str) -> subprocess.Popen:
    from predd.server.launch import die_with_parent, wait_ready
    proc = subprocess.Popen([sys.executable, "-m", "kvfsd", mount, "--predd", addr,
                             "--state", state, "--names-per-uid", "0"],
                            stdout=subprocess.PIPE, stderr=open(f"{state}.log", "ab"),
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                            preexec_fn=die_with_parent)
    if wait_ready(proc, 60) != mount:
        raise RuntimeError(f"kvfsd did not mount; see {state}.log")
    return proc


def create(paths: list[str], workers: int) -> float:
    """Create empty cache files; seconds taken."""
    def one(path: str) -> None:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    t = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for _ in pool.map(one, paths, chunksize=64):
            pass
    return time.perf_counter() - t


def fill_directory(d: str, n: int, workers: int) -> None:
    os.mkdir(d)
    chunk = 10_000
    for start in range(0, n, chunk):
        names = [os.path.join(d, f"f{i:06d}.kv") for i in range(start, min(n, start + chunk))]
        took = create(names, workers)
        if n > chunk:
            log(f"  {start + len(names)} files: {len(names) / took:.0f} creates/s")


def cp(src: str, dst: str) -> None:
    """As coreutils: the source stays open (its capability valid) until the
    destination is closed, which makes the fork."""
    fd = os.open(src, os.O_RDONLY)
    try:
        desc = os.read(fd, 4096)
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(out, desc)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def timed_rounds(d: str, src: str, k: int) -> dict[str, list[float]]:
    """K rounds of touch, cp, mv, rm, stat in directory `d`: ms per op."""
    times: dict[str, list[float]] = {op: [] for op in OPS}
    existing = sorted(os.listdir(d))
    for j in range(k):
        new, copy, moved = (os.path.join(d, f"{what}{j}.kv") for what in ("t", "c", "m"))
        steps = (("touch", lambda: os.close(os.open(new, os.O_WRONLY | os.O_CREAT
                                                    | os.O_EXCL, 0o600))),
                 ("cp", lambda: cp(src, copy)),
                 ("mv", lambda: os.rename(new, moved)),
                 ("rm", lambda: (os.unlink(moved), os.unlink(copy))),
                 ("stat", lambda: os.lstat(os.path.join(d, existing[j % len(existing)]))))
        for op, fn in steps:
            t = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t) * 1000
            times[op].append(ms / 2 if op == "rm" else ms)   # rm: two unlinks
    return times


def run_ls(d: str, *flags: str) -> tuple[float, int]:
    t = time.perf_counter()
    out = subprocess.run(["ls", *flags, d], capture_output=True, check=True,
                         env={**os.environ, "LC_ALL": "C"}).stdout
    return time.perf_counter() - t, out.count(b"\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=100_000, help="the big directory's size")
    ap.add_argument("--ops", type=int, default=200, help="timed rounds per size")
    ap.add_argument("--workers", type=int, default=8, help="concurrent creators")
    ap.add_argument("--no-ls-long", action="store_true", help="skip `ls -l`")
    args = ap.parse_args()

    import liblip
    from predd.server import launch
    from predd.server.launch import terminate

    tmp = tempfile.mkdtemp(prefix="bench-kvfs-")
    mount = tempfile.mkdtemp(prefix="kvfs-mnt-", dir="/tmp")
    daemon = launch.start(os.path.join(tmp, "predd"), "--kv-pages", "256")
    kvfsd = None
    try:
        kvfsd = start_kvfsd(daemon.addr, mount, os.path.join(tmp, "state"))
        liblip.connect(daemon.addr)
        src = os.path.join(mount, "src.kv")
        os.close(os.open(src, os.O_WRONLY | os.O_CREAT, 0o600))
        kv = liblip.kv_open(src, write=True)
        liblip.prefill(kv, liblip.tokenize("The quick brown fox jumps over the lazy dog. "
                                           * 3)[:20])
        liblip.kv_close(kv)
        hardware = {"machine": platform.machine(), "cpus": os.cpu_count(),
                    "python": platform.python_version()}
        per_size: dict[int, dict[str, list[float]]] = {}
        for size in (10, args.files):
            d = os.path.join(mount, f"d{size}")
            t = time.perf_counter()
            fill_directory(d, size, args.workers)
            made = time.perf_counter() - t
            log(f"{size} files made in {made:.1f} s ({size / made:.0f}/s)")
            per_size[size] = timed_rounds(d, src, args.ops)
            for op in OPS:
                log(f"  {op}: median {statistics.median(per_size[size][op]):.2f} ms")
        for op in OPS:
            small = statistics.median(per_size[10][op])
            big = statistics.median(per_size[args.files][op])
            print("RESULT " + json.dumps({
                "bench": f"kvfs_{op}_per_op", "files": args.files, "baseline_files": 10,
                "ms_median": round(big, 3), "baseline_ms_median": round(small, 3),
                "ms_mean": round(statistics.fmean(per_size[args.files][op]), 3),
                "baseline_ms_mean": round(statistics.fmean(per_size[10][op]), 3),
                "ratio": round(big / small, 3), "ops": args.ops, **hardware}), flush=True)
        big_dir = os.path.join(mount, f"d{args.files}")
        for flags in ((), ("-l",)) if not args.no_ls_long else ((),):
            seconds, lines = run_ls(big_dir, *flags)
            small_s, _ = run_ls(os.path.join(mount, "d10"), *flags)
            print("RESULT " + json.dumps({
                "bench": "kvfs_ls" + "".join(flags).replace("-", "_"), "files": args.files,
                "seconds": round(seconds, 3), "lines": lines,
                "baseline_files": 10, "baseline_seconds": round(small_s, 4),
                "us_per_file": round(seconds / args.files * 1e6, 1), **hardware}),
                flush=True)
        report = liblip.fsck()
        log(f"predd fsck clean: {report['clean']}")
    finally:
        if kvfsd is not None:
            code = terminate(kvfsd, 120)
            log(f"kvfsd exited {code}")
        subprocess.run(["fusermount3", "-u", "-z", mount], check=False,
                       stderr=subprocess.DEVNULL)
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.rmdir(mount)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
