"""B3, fork: how long a copy-on-write fork of a KV cache takes, by cache size, against
computing the same tokens again.

For each size in --sizes (16 ... 8192 tokens: SmolLM2's whole context) a cache of that
many seeded tokens is prefilled into a fresh object: that prefill, timed, is the
baseline (re-prefill: what a system without fork pays to get a second copy; best of
--prefill-repeat, once from 4096 tokens on). Then, --repeat times each (the median and
the best are reported):

  kv_fork    liblip's `kv_fork` of the object (one round trip to predd), then kv_free;
  cp         `cp src.kv dst.kv` on a real kvfsd mount, the coreutils binary run as a
             process (its exec included), then rm;
  copy       the same syscalls `cp` makes (open, read, create, write, close), from this
             process (shutil.copyfile): the fork without the exec.

Every fork is checked once per size: the copy has the source's tokens
(`user.kv.tokens`) and predd allocated no page for it. RESULT lines: per size and way,
the speedup over re-prefill (ratio = prefill seconds / fork seconds; target >= 100 at
8192) and, per way, the flatness (ratio = fork at the largest size / at the smallest;
target <= 2).

    python scripts/bench_fork.py [--sizes 16,64,256,1024,4096,8192] [--repeat 50]
        [--ways kv_fork,cp,copy] [--quick]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts.bench_common import (DTYPE_CHOICES, Mount, log, machine,  # noqa: E402
                                  quick_defaults, result, start_predd)

PAGE = 16
WAYS = ("kv_fork", "cp", "copy")


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    """n seeded token ids, clear of the special ids at the start of the vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def prefill_seconds(lip, toks: list[int], repeat: int):
    """(best seconds of `repeat` prefills of `toks` into fresh objects, the last object)."""
    best, kv = float("inf"), None
    for _ in range(repeat):
        if kv is not None:
            lip.kv_free(kv)
        kv = lip.kv_create()
        t0 = time.perf_counter()
        cost = lip.prefill(kv, toks)
        best = min(best, time.perf_counter() - t0)
        if cost.get("computed") != len(toks):
            raise RuntimeError(f"prefill computed {cost.get('computed')} of {len(toks)} tokens")
    return best, kv


def time_fork(way: str, lip, kv, src: str, dst: str) -> float:
    t0 = time.perf_counter()
    if way == "kv_fork":
        child = lip.kv_fork(kv)
        elapsed = time.perf_counter() - t0
        lip.kv_free(child)
        return elapsed
    if way == "cp":
        subprocess.run(["cp", src, dst], check=True)
    else:
        shutil.copyfile(src, dst)
    elapsed = time.perf_counter() - t0
    os.unlink(dst)
    return elapsed


def check_fork(way: str, lip, kv, src: str, dst: str, n: int) -> None:
    """One fork, untimed: the copy holds n tokens and took no page."""
    used = lip.stats()["pages_used"]
    if way == "kv_fork":
        child = lip.kv_fork(kv)
        got, pages = lip.kv_stat(child)["tokens"], lip.stats()["pages_used"] - used
        lip.kv_free(child)
    else:
        subprocess.run(["cp", src, dst], check=True) if way == "cp" else \
            shutil.copyfile(src, dst)
        got = int(os.getxattr(dst, "user.kv.tokens"))
        pages = lip.stats()["pages_used"] - used
        os.unlink(dst)
    if got != n or pages != 0:
        raise RuntimeError(f"{way}: the fork has {got} tokens (want {n}) and took "
                           f"{pages} pages (want 0)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="16,64,256,1024,4096,8192")
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--repeat", type=int, default=50, help="forks per size and way")
    ap.add_argument("--prefill-repeat", type=int, default=3,
                    help="re-prefills per size below 4096 tokens (the best counts)")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: sizes 16,256,1024, 10 forks, one prefill each "
                         "(each unless given)")
    args = ap.parse_args()
    quick_defaults(ap, args, {"sizes": "16,256,1024", "repeat": 10,
                             "prefill_repeat": 1})
    sizes = sorted(int(s) for s in args.sizes.split(","))
    ways = args.ways.split(",")
    if set(ways) - set(WAYS) or sizes[0] < 1 or args.repeat < 1:
        ap.error(f"bad --ways or --sizes: {ways} {sizes}")
    args.dtype = machine(args.dtype)

    daemon = start_predd("--dtype", args.dtype,
                         "--kv-pages", str(-(-sizes[-1] // PAGE) + 64))
    try:
        import liblip as lip
        lip.connect(daemon.addr)
        info = lip.info()
        if sizes[-1] > info["max_position"]:
            ap.error(f"the model's context is {info['max_position']} tokens")
        with Mount(daemon.addr) as mount:
            measured = measure(args, lip, info, mount.path, sizes, ways)
        lip.client().close()
    finally:
        daemon.stop()
    report(args, sizes, ways, measured)
    return 0


def measure(args, lip, info: dict, mount: str, sizes: list[int], ways: list[str]) -> dict:
    """size -> {"prefill": seconds, way: [seconds...]}."""
    out: dict = {}
    for n in sizes:
        toks = tokens(n, info["vocab_size"], args.seed + n)
        prefill, kv = prefill_seconds(lip, toks, 1 if n >= 4096 else args.prefill_repeat)
        src, dst = os.path.join(mount, f"src-{n}.kv"), os.path.join(mount, f"dst-{n}.kv")
        lip.kv_save(kv, src)
        row = {"prefill": prefill}
        for way in ways:
            check_fork(way, lip, kv, src, dst, n)
            time_fork(way, lip, kv, src, dst)                  # warm-up
            row[way] = [time_fork(way, lip, kv, src, dst) for _ in range(args.repeat)]
        os.unlink(src)
        lip.kv_free(kv)
        log(f"bench: {n} tokens: re-prefill {prefill * 1e3:.1f} ms; " + ", ".join(
            f"{w} median {statistics.median(row[w]) * 1e3:.3f} ms (best "
            f"{min(row[w]) * 1e3:.3f})" for w in ways))
        out[n] = row
    return out


def report(args, sizes: list[int], ways: list[str], measured: dict) -> None:
    common = {"dtype": args.dtype, "repeat": args.repeat}
    for n in sizes:
        row = measured[n]
        for way in ways:
            med = statistics.median(row[way])
            result("fork_vs_prefill", "seconds", med, "re_prefill", row["prefill"],
                   ratio=round(row["prefill"] / med, 1), ratio_is="baseline / symphony",
                   way=way, tokens=n, best_s=round(min(row[way]), 6), **common)
    lo, hi = sizes[0], sizes[-1]
    for way in ways:
        a, b = statistics.median(measured[lo][way]), statistics.median(measured[hi][way])
        result("fork_flatness", "seconds", b, f"{way}_at_{lo}_tokens", a,
               ratio=round(b / a, 3), ratio_is="symphony / baseline", way=way,
               tokens=hi, baseline_tokens=lo, **common)


if __name__ == "__main__":
    sys.exit(main())
