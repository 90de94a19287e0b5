"""The cluster simulation's real point: bench_rag.py's base setup on two
predd replicas under one kvfsd, runs placed by round-robin and by cache affinity.

Each replica is a predd with one thread (the two share this machine's cores) and
bench_rag's base KV memory (a quarter of all documents' tokens); each runs its own
mount_examples/rag_popular.py, which keeps its documents' caches as files in its own
directory (homed on its replica: `user.kv.replica`). Per replica --clients closed-loop
clients (the simulation's weak scaling), --warmup untimed and --requests timed requests
each, Pareto(--alpha) popularity, from a cold cache. Placement:

  round-robin     request i to replica i mod 2
  cache-affinity  gatewayd.placement's rule, as the gateway places runs `near` files:
                  the replica whose file for the document holds the most tokens, among
                  those not above 1.5x the mean requests in flight; else the least loaded

The same setup simulated: `scripts/simulate_cluster.py --check-rag ALPHA
--check-replicas 2` (docs/scaling.md compares them).

    python scripts/bench_replicas.py [--alpha 1] [--requests 64] [--warmup 32] [--quick]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from gatewayd.placement import choose  # noqa: E402
from scripts.bench_common import (Mount, log, machine, percentile,  # noqa: E402
                                  quick_defaults, serving_flags, start_predd)
from scripts.bench_rag import LipProcess, budgets, drained  # noqa: E402
from scripts.rag_workload import (Request, closed_loop, make_workload,  # noqa: E402
                                  workload_flags)

REPLICAS = 2


class Cluster:
    """Two predds (one thread each), kvfsd over both, one rag_popular.py per replica."""

    def __init__(self, args, work, pages: int) -> None:
        import liblip as lip
        self.args, self.work = args, work
        self.daemons = []
        self.docs = tempfile.mkdtemp(prefix="rag-docs-")
        self.mount = None
        try:
            for _ in range(REPLICAS):
                self.daemons.append(start_predd(
                    "--dtype", args.dtype, "--kv-pages", str(pages), "--threads", "1",
                    "--max-step-tokens", str(args.step_tokens)))
            for name, text in work.docs.items():
                with open(os.path.join(self.docs, f"{name}.txt"), "w") as f:
                    f.write(text)
            self.mount = Mount(*(d.addr for d in self.daemons))
        except BaseException:
            self.close()
            raise
        self.pythonpath = os.path.dirname(os.path.dirname(lip.__file__))

    def dirs(self, policy: str) -> list[str]:
        return [os.path.join(self.mount.path, f"{policy}-r{k}") for k in range(REPLICAS)]

    def run(self, policy: str) -> dict:
        lips = [LipProcess({**os.environ, "PREDD_ADDR": d.addr, "KVFS_MOUNT": self.mount.path,
                            "PYTHONPATH": self.pythonpath}, "--docs", self.docs, "--dir", path)
                for d, path in zip(self.daemons, self.dirs(policy))]
        inflight = [0] * REPLICAS
        placed = [0] * REPLICAS
        lock = threading.Lock()
        turn = iter(range(10**9))

        def held(r: Request) -> list[int]:
            """Tokens of r's document cached on each replica (its LIP's file)."""
            out = []
            for path in self.dirs(policy):
                try:
                    out.append(int(os.getxattr(os.path.join(path, f"{r.doc}.kv"),
                                               "user.kv.tokens")))
                except OSError:
                    out.append(0)
            return out

        def submit(r: Request) -> dict:
            with lock:
                if policy == "round-robin":
                    k = next(turn) % REPLICAS
                else:
                    k = choose(inflight, held(r))
                inflight[k] += 1
                placed[k] += 1
            try:
                return lips[k].submit(r, self.args.new_tokens)
            finally:
                with lock:
                    inflight[k] -= 1

        try:
            warm, timed = self.work.runs[self.args.alpha]
            closed_loop(warm, self.args.clients * REPLICAS, submit)
            placed[:] = [0] * REPLICAS
            run = closed_loop(timed, self.args.clients * REPLICAS, submit)
        finally:
            for p in lips:
                p.close()
            for path in self.dirs(policy):
                shutil.rmtree(path, ignore_errors=True)
            for d in self.daemons:
                drained(d.addr)
        hits = sum(r["hit"] for r in run.replies)
        out = {"policy": policy, "rate": run.rate(), "hits": hits, "n": len(timed),
               "p50": percentile(run.latencies, 50), "p99": percentile(run.latencies, 99),
               "placed": placed}
        log(f"bench: 2 replicas, {policy}: {run.rate():.2f} requests/s, hits "
            f"{hits}/{len(timed)}, p50 {out['p50']:.2f} s, p99 {out['p99']:.2f} s, "
            f"placed {placed}")
        return out

    def close(self) -> None:
        if self.mount is not None:
            self.mount.close()
        for d in self.daemons:
            d.stop()
        shutil.rmtree(self.docs, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_flags(ap, "per replica")
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=64, help="timed requests per replica")
    ap.add_argument("--warmup", type=int, default=32, help="untimed requests per replica")
    ap.add_argument("--kv-share", type=float, default=0.25,
                    help="a replica's KV memory, as a share of all documents' tokens")
    ap.add_argument("--policies", default="round-robin,cache-affinity")
    serving_flags(ap, "a smoke run: 16 documents of ~96 tokens, 2 clients a replica, "
                      "4+8 requests a replica, 8 new tokens")
    args = ap.parse_args()
    quick_defaults(ap, args, {"docs": 16, "doc_tokens": 96, "clients": 2, "warmup": 4,
                              "requests": 8, "new_tokens": 8})
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.dtype = machine(args.dtype)
    # make_workload draws per alpha `warmup` + `requests` requests: here per replica
    args.alphas, args.requests, args.warmup = ([args.alpha], args.requests * REPLICAS,
                                               args.warmup * REPLICAS)
    probe = start_predd("--dtype", args.dtype, "--kv-pages", "64")
    try:
        import liblip as lip
        lip.connect(probe.addr)
        work = make_workload(args)
        lip.client().close()
    finally:
        probe.stop()
    pages = budgets(args, work)["base"].device_pages
    log(f"bench: {args.docs} documents, alpha {args.alpha}, {REPLICAS} replicas of "
        f"{pages} pages and 1 thread each, {args.clients} clients a replica, "
        f"{args.warmup} warm-up + {args.requests} timed requests in all")
    cluster = Cluster(args, work, pages)
    try:
        results = [cluster.run(p) for p in args.policies.split(",")]
    finally:
        cluster.close()
    for r in results:
        print(f"| {r['policy']} | {r['rate']:.2f} | {r['hits']}/{r['n']} | {r['p50']:.2f} "
              f"| {r['p99']:.2f} | {r['placed'][0]}/{r['placed'][1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
