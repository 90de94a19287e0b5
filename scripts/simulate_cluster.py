"""How 1-64 predd replicas behind round-robin, least-loaded and cache-affinity
placement would do on RAG and agent workloads, by a discrete-event model
(cluster_sim.py) driven by step costs measured from a real predd.

    python scripts/simulate_cluster.py [--replicas 1,2,4,8,16,32,64]
        [--workloads rag0.5,rag1,rag1.5,rag2,agent] [--policies ...]
        [--requests 1000] [--clients 8] [--kv-tokens 32768]
        [--costs docs/scaling_costs.json] [--plot docs/scaling_sim.png] [--quick]
    python scripts/simulate_cluster.py --calibrate [--costs docs/scaling_costs.json]
    python scripts/simulate_cluster.py --check-rag ALPHA      # bench_rag.py's setup, 1 replica
    python scripts/simulate_cluster.py --check-rag ALPHA --check-replicas 2
                                 # the same at 2 replicas: what scripts/bench_replicas.py runs

The table (markdown) goes to stdout, progress to stderr. --requests and --clients are
per replica: the load grows with the cluster. The first half of each run's requests is
a warm-up; figures are over the second half. --calibrate starts a predd (bench_common)
and measures prefill, decode steps by batch and context, and kv_export + kv_import,
then writes the costs JSON the simulation reads.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts.bench_common import quick_defaults  # noqa: E402
from scripts.cluster_placement import POLICIES  # noqa: E402
from scripts.cluster_sim import Cluster, Costs, ReplicaConfig, Result  # noqa: E402
from scripts.cluster_workload import Agent, Rag  # noqa: E402

COSTS = os.path.join(ROOT, "docs", "scaling_costs.json")
PLOT = os.path.join(ROOT, "docs", "scaling_sim.png")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def workload(name: str, seed: int):
    if name == "agent":
        return Agent(seed=seed)
    if name.startswith("rag"):
        return Rag(alpha=float(name[3:]), seed=seed)
    raise ValueError(f"unknown workload {name!r} (rag<alpha> or agent)")


def simulate(args, costs: Costs) -> list[Result]:
    config = ReplicaConfig(kv_tokens=args.kv_tokens)
    out = []
    for w in args.workloads:
        for n in args.replicas:
            for p in args.policies:
                t0 = time.perf_counter()
                res = Cluster(n, POLICIES[p](), workload(w, args.seed), args.clients * n,
                              costs, config).run(args.requests * n, args.requests * n // 2)
                log(f"sim: {w} x{n} {p}: {res.throughput:.2f} runs/s, hit "
                    f"{res.hit_rate:.3f} ({time.perf_counter() - t0:.1f} s)")
                out.append(res)
    return out


def table(results: list[Result]) -> str:
    """Per workload and cluster size, each policy's figures, and against 1 replica."""
    single = {(r.workload, r.policy): r for r in results if r.replicas == 1}
    rows = ["| workload | replicas | policy | runs/s | × 1 replica | hit rate | "
            "/ 1 replica's | p50 s | p99 s | migrations | MB migrated / run |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        one = single.get((r.workload, r.policy))
        speedup = f"{r.throughput / one.throughput:.1f}" if one else "–"
        kept = f"{r.hit_rate / one.hit_rate:.2f}" if one and one.hit_rate else "–"
        rows.append(f"| {r.workload} | {r.replicas} | {r.policy} | {r.throughput:.2f} | "
                    f"{speedup} | {r.hit_rate:.3f} | {kept} | {r.latency(50):.2f} | "
                    f"{r.latency(99):.2f} | {r.migrations} | "
                    f"{r.bytes_migrated / 1e6 / max(r.runs, 1):.2f} |")
    return "\n".join(rows)


def plot(results: list[Result], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("sim: matplotlib is not installed, so no plot: `pip install matplotlib` "
            "(or the project's `sim` extra) and run again")
        return False
    names = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(2, len(names), figsize=(3.2 * len(names), 6), squeeze=False)
    for col, w in enumerate(names):
        for p in dict.fromkeys(r.policy for r in results):
            rs = [r for r in results if r.workload == w and r.policy == p]
            one = next((r for r in rs if r.replicas == 1), None)
            xs = [r.replicas for r in rs]
            if one:
                axes[0][col].plot(xs, [r.throughput / one.throughput for r in rs],
                                  marker="o", label=p)
            axes[1][col].plot(xs, [r.hit_rate for r in rs], marker="o", label=p)
        xs = sorted({r.replicas for r in results})
        axes[0][col].plot(xs, xs, ls=":", c="grey", label="linear")
        axes[0][col].set(title=w, xscale="log", yscale="log", xlabel="replicas")
        axes[1][col].set(xscale="log", ylim=(0, 1.05), xlabel="replicas")
        for ax in axes[:, col]:
            ax.set_xticks(xs, [str(x) for x in xs])
    axes[0][0].set_ylabel("throughput / 1 replica's")
    axes[1][0].set_ylabel("hit rate")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"sim: wrote {path}")
    return True


def check_rag(args, costs: Costs) -> None:
    """bench_rag.py's base setup: 64 documents of ~403 tokens (its system turn),
    ~22-token questions, 32 tokens, 402 pages a replica, Pareto(alpha); per replica 8
    clients, 32 warm-up runs and 64 measured. One replica: least-loaded (all policies
    are the same); more (scripts/bench_replicas.py's setup): round-robin and
    cache-affinity."""
    n = args.check_replicas
    policies = ("least-loaded",) if n == 1 else ("round-robin", "cache-affinity")
    for p in policies:
        w = Rag(alpha=args.check_rag, docs=64, doc_tokens=403, question_tokens=22,
                answer_tokens=32, seed=args.seed, pareto=True)
        res = Cluster(n, POLICIES[p](), w, 8 * n, costs,
                      ReplicaConfig(kv_tokens=402 * 16)).run(96 * n, 32 * n)
        print(f"bench_rag setup, Pareto alpha {args.check_rag:g}, {n} replica(s), {p}: "
              f"{res.throughput:.2f} requests/s, hits {res.hits}/{res.named}, "
              f"p50 {res.latency(50):.2f} s, p99 {res.latency(99):.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64")
    ap.add_argument("--workloads", default="rag0.5,rag1,rag1.5,rag2,agent")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--requests", type=int, default=1000,
                    help="runs per replica (the first half a warm-up)")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients per replica")
    ap.add_argument("--kv-tokens", type=int, default=32768,
                    help="a replica's KV memory (predd's default 2048 pages x 16)")
    ap.add_argument("--costs", default=COSTS)
    ap.add_argument("--plot", default=PLOT, help="the PNG ('' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="1,4,16 replicas, rag1 and agent, 200 runs per replica")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure a real predd here and write --costs")
    ap.add_argument("--check-rag", type=float, metavar="ALPHA",
                    help="simulate bench_rag.py's setup and stop")
    ap.add_argument("--check-replicas", type=int, default=1, metavar="N",
                    help="--check-rag at N replicas (round-robin and cache-affinity)")
    args = ap.parse_args()
    if args.calibrate:
        from scripts.cluster_calibrate import calibrate
        calibrate(args.costs)
        return 0
    if not os.path.exists(args.costs):
        ap.error(f"no costs at {args.costs}: run with --calibrate first")
    costs = Costs.load(args.costs)
    if args.check_rag is not None:
        check_rag(args, costs)
        return 0
    quick_defaults(ap, args, {"replicas": "1,4,16", "workloads": "rag1,agent",
                              "requests": 200})
    args.replicas = [int(x) for x in args.replicas.split(",")]
    args.workloads = args.workloads.split(",")
    args.policies = args.policies.split(",")
    if set(args.policies) - set(POLICIES) or min(args.replicas) < 1 or args.requests < 2:
        ap.error(f"policies are {', '.join(POLICIES)}; replicas >= 1; requests >= 2")
    results = simulate(args, costs)
    print(table(results))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
