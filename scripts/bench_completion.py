"""B1, completion throughput: Symphony's ways to decode against vLLM and transformers.

N concurrent programs (N in --programs, default 1,8,32,64) x --new-tokens (64) greedy
tokens each, seeded prompts of ~20-60 tokens, run as N separate processes and as N
threads of one process (--as):
  generate     — predd's own decode loop, streaming
  pred_loop    — a `pred` loop with client-side argmax over the full logits
  pred_sample  — `pred_sample`: server-side greedy sampling (only the token returns)
against, in the same run and the same dtype (predd stopped while they run):
  vllm_offline — vLLM's CPU build, `LLM.generate` on the N prompts at once
  vllm_server  — vLLM's OpenAI server, N concurrent HTTP clients (processes or threads,
                 as the programs) posting /v1/completions with token-id prompts
  transformers — `generate` on the N prompts in one left-padded batch
  llama_cpp    — llama.cpp's `llama-batched-bench` on the same GGUF file: N sequences
                 of the prompts' mean length, each generating --new-tokens; its time
                 includes the prompts, as the programs' does (scripts/bench_llama_cpp.py)
vLLM and llama.cpp come from `make bench-setup` (see scripts/bench_vllm.py and
bench_llama_cpp.py), vLLM with a KV budget equal to predd's; if one cannot run, the
bench says why and goes on without it. Each figure is
the best of --repeat timed runs (shared hosts are noisy). Prints one `RESULT {...}` line
per comparison: ratios, not timed asserts.

    python scripts/bench_completion.py [--programs 1,8,32,64] [--as processes,threads]
        [--new-tokens 64] [--modes generate,pred_loop,pred_sample] [--dtype auto] [--repeat 3]
        [--baselines vllm_offline,vllm_server,transformers,llama_cpp] [--quick]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts import bench_llama_cpp, bench_vllm  # noqa: E402
from scripts.bench_common import (DTYPE_CHOICES, best_of, changed, log, machine,  # noqa: E402
                                  start_predd)
from scripts.bench_common import result as emit  # noqa: E402

WORDS = ("the a cache page token model program fork kernel batch prompt system user "
         "river mountain city music memory garden light window story number").split()
KV_PAGES, PAGE_SIZE, STEP_TOKENS = 1024, 16, 2048    # predd's; vLLM gets the same budget
START_TIMEOUT_S = 600


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(18, 55))) for _ in range(n)]


# ------------------------------------------------------- N programs, two ways

@dataclass(frozen=True)
class Workload:
    """What one program does. `setup` runs once per process; `prepare(prompt)` once per
    program before the start line and returns the timed part, which returns the ids;
    `teardown` once per process at its end (multiprocessing's children leave by
    os._exit, so no atexit handler runs there)."""
    setup: Callable[[], None]
    prepare: Callable[[list[int]], Callable[[], list[int]]]
    teardown: Callable[[], None] = lambda: None


def _report(out, i: int, run: Callable[[], list[int]], clock: Callable[[], float]) -> None:
    """Puts (i, the ids or why not, the CPU seconds `clock` counted during the run)."""
    started = clock()
    try:
        out.put((i, run(), clock() - started))
    except BaseException as e:       # the parent must hear of it, not wait forever
        out.put((i, f"{type(e).__name__}: {e}", 0.0))


def _prepared(w: Workload, prompts: list[list[int]], start, out) -> list | None:
    """The programs' timed parts; on a failure, says so and breaks the start line."""
    try:
        w.setup()
        return [w.prepare(p) for p in prompts]
    except BaseException as e:
        out.put((-1, f"{type(e).__name__}: {e}"))
        start.abort()
        return None


def _as_process(w: Workload, i: int, prompt: list[int], start, out) -> None:
    runs = _prepared(w, [prompt], start, out)
    if runs:
        start.wait(START_TIMEOUT_S)
        _report(out, i, runs[0], time.process_time)   # its liblip threads' too
        w.teardown()


def _as_threads(w: Workload, prompts: list[list[int]], start, out) -> None:
    runs = _prepared(w, prompts, start, out)
    if not runs:
        return
    go = threading.Barrier(len(runs) + 1)

    def body(i: int, run: Callable[[], list[int]]) -> None:
        go.wait()
        _report(out, i, run, time.thread_time)
    threads = [threading.Thread(target=body, args=(i, r)) for i, r in enumerate(runs)]
    for t in threads:
        t.start()
    start.wait(START_TIMEOUT_S)
    go.wait()
    for t in threads:
        t.join()
    w.teardown()


def run_programs(as_: str, w: Workload, prompts: list[list[int]]
                 ) -> tuple[float, list, float]:
    """Seconds from the common start until every program has its ids; ids by prompt; the
    programs' CPU seconds in their timed parts (as threads: each program's own thread)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    if as_ == "processes":
        start = ctx.Barrier(len(prompts) + 1)
        procs = [ctx.Process(target=_as_process, args=(w, i, p, start, out))
                 for i, p in enumerate(prompts)]
    else:
        start = ctx.Barrier(2)
        procs = [ctx.Process(target=_as_threads, args=(w, prompts, start, out))]
    for proc in procs:
        proc.start()
    try:
        try:
            start.wait(START_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"a program failed before the start: {out.get(timeout=5)[1]}")
        t0 = time.perf_counter()
        results, cpu = {}, 0.0
        for _ in prompts:
            i, ids, seconds = out.get(timeout=START_TIMEOUT_S)
            results[i] = ids
            cpu += seconds
        elapsed = time.perf_counter() - t0
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    failed = [r for r in results.values() if isinstance(r, str)]
    if failed:
        raise RuntimeError(f"{len(failed)} program(s) failed, e.g. {failed[0]}")
    return elapsed, [results[i] for i in range(len(prompts))], cpu


def symphony(mode: str, addr: str, n_new: int) -> Workload:
    import liblip as lip

    def decode(kv, tokens: list[int]) -> list[int]:
        if mode == "generate":
            return lip.generate(kv, tokens, max_tokens=n_new, ignore_eos=True)
        ids: list[int] = []
        if mode == "pred_sample":
            step = tokens
            for _ in range(n_new):
                ids.append(lip.pred_sample(kv, step, {"temperature": 0.0}).token)
                step = [ids[-1]]
            return ids
        dist = lip.pred(kv, tokens)
        for _ in range(n_new):
            ids.append(dist.argmax())
            if len(ids) < n_new:
                dist = lip.pred(kv, [ids[-1]])
        return ids

    def prepare(tokens: list[int]) -> Callable[[], list[int]]:
        kv = lip.kv_create()
        return lambda: decode(kv, tokens)
    # bye at the end: predd frees the programs' caches at once, not when their session's
    # lease runs out (10 s), so the next run finds the whole pool free
    return Workload(lambda: lip.connect(addr), prepare, lambda: lip.client().close())


def vllm_http(url: str, n_new: int) -> Workload:
    import httpx

    def prepare(tokens: list[int]) -> Callable[[], list[int]]:
        client = httpx.Client(base_url=url, timeout=START_TIMEOUT_S)   # one connection each
        body = bench_vllm.completion_request(tokens, n_new)

        def run() -> list[int]:
            reply = client.post("/v1/completions", json=body)
            reply.raise_for_status()
            ids = bench_vllm.completion_ids(reply.json())
            if len(ids) != n_new:
                raise RuntimeError(f"vLLM returned {len(ids)} token ids, not {n_new}")
            return ids
        return run
    return Workload(lambda: None, prepare)


# ------------------------------------------------------------------ the systems

def measure_symphony(args, prompts: list[list[int]], addr: str) -> dict:
    """(as, N, mode) -> (best seconds, ids)."""
    import liblip as lip
    results = {}

    def stats() -> dict:
        lip.connect(addr)                   # closed again before the next fork
        s = lip.stats()
        lip.client().close()
        return s

    def flown(s: dict) -> int:      # 0 from an older predd
        return s.get("answered_in_flight", 0)
    for as_ in args.as_:
        for n in args.programs:
            for mode in args.modes:
                w = symphony(mode, addr, args.new_tokens)
                run_programs(as_, symphony(mode, addr, 4), prompts[:min(n, 4)])   # warm-up
                for _ in range(args.repeat):
                    before = stats()
                    elapsed, outs, cpu = run_programs(as_, w, prompts[:n])
                    after = stats()
                    steps = max(after["steps"] - before["steps"], 1)
                    key = (as_, n, mode)
                    if key not in results or elapsed < results[key][0]:
                        results[key] = (elapsed, outs)
                    log(f"bench: symphony {mode} x{n} {as_}: {elapsed:.2f}s "
                        f"({n * args.new_tokens / elapsed:.0f} tokens/s), {steps} steps, "
                        f"mean batch {(after['calls'] - before['calls']) / steps:.1f}, step "
                        f"{(after['step_ms'] - before['step_ms']) / steps:.1f} ms, launch wait "
                        f"{after['launch_wait_ms'] - before['launch_wait_ms']:.0f} ms, "
                        f"logits rows {changed(before, after, 'logits_rows')}, requests "
                        f"answered in flight {flown(after) - flown(before)}, programs' "
                        f"CPU {cpu * 1e6 / (n * args.new_tokens):.0f} us a token; "
                        f"ms a step: {changed(before, after, 'time_ms', steps)}")
    return results


def measure_vllm(args, prompts: list[list[int]]) -> dict:
    """('offline', N) and ('server', as, N) -> (best seconds, ids); empty if vLLM can't."""
    results: dict = {}
    engine = (args.dtype, KV_PAGES * PAGE_SIZE, max(64, *args.programs), STEP_TOKENS)
    try:
        if "vllm_offline" in args.baselines:
            log("bench: vLLM offline LLM.generate (its first start compiles for minutes) ...")
            jobs = [prompts[:n] for n in args.programs]
            best = bench_vllm.offline(jobs, args.new_tokens, *engine, args.repeat, log=log)
            for n, r in zip(args.programs, best):
                results[("offline", n)] = r
        if "vllm_server" in args.baselines:
            with bench_vllm.Server(*engine, log=log) as server:
                for as_ in args.as_:
                    for n in args.programs:
                        run_programs(as_, vllm_http(server.url, 4), prompts[:min(n, 4)])
                        r = best_of(args.repeat, lambda: run_programs(
                            as_, vllm_http(server.url, args.new_tokens), prompts[:n]))
                        log(f"bench: vllm server x{n} {as_}: {r[0]:.2f}s")
                        results[("server", as_, n)] = r
    except bench_vllm.Unavailable as e:
        log(f"bench: vLLM baseline unavailable: {e}")
    return results


def measure_llama_cpp(args, prompts: list[list[int]]) -> dict:
    """N -> (best seconds, None) of llama-batched-bench on N sequences; empty where it
    cannot run (it computes in the GGUF's own types, whatever --dtype)."""
    from predd.model.loader import default_model_path
    mean = round(sum(map(len, prompts)) / len(prompts))
    try:
        rows = bench_llama_cpp.batched(default_model_path(), args.programs, mean,
                                       args.new_tokens, os.cpu_count() or 2, args.repeat,
                                       log=log)
    except bench_llama_cpp.Unavailable as e:
        log(f"bench: llama.cpp baseline unavailable: {e}")
        return {}
    return {n: (seconds, None, tg) for n, (seconds, tg) in rows.items()}


def transformers_model(dtype: str):
    """LlamaForCausalLM on the same dequantised weights predd serves: the bench-setup
    export if there is one, else built here from predd's loader (transformers' own GGUF
    loader would keep the weights packed)."""
    import torch
    import transformers
    torch_dtype = getattr(torch, dtype)
    try:
        _, export = bench_vllm.locate()
        return transformers.LlamaForCausalLM.from_pretrained(export, dtype=torch_dtype).eval()
    except bench_vllm.Unavailable:
        pass
    from scripts.bench_export import llama_config
    from predd.model.loader import default_model_path, load_weights
    cfg, weights = load_weights(default_model_path(), torch_dtype)
    model = transformers.LlamaForCausalLM(llama_config(cfg)).to(torch_dtype)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    return model.eval()


def measure_transformers(args, prompts: list[list[int]]) -> dict:
    """N -> (best seconds, ids) of one batched greedy `generate` over N prompts."""
    import torch
    model = transformers_model(args.dtype)
    results = {}
    for n in args.programs:
        batch = prompts[:n]
        width = max(map(len, batch))
        ids = torch.full((n, width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):               # left padding, as for batched decoding
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1

        def generate(new: int, rows: int = n) -> tuple[float, list]:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(ids[:rows], attention_mask=mask[:rows], max_new_tokens=new,
                                     do_sample=False, pad_token_id=2, eos_token_id=None)
            return time.perf_counter() - t0, out[:, width:].tolist()
        generate(4, min(n, 2))                                              # warm-up
        results[n] = best_of(args.repeat, lambda: generate(args.new_tokens))
        log(f"bench: transformers x{n}: {results[n][0]:.2f}s")
    return results


# ------------------------------------------------------------------ report

def result(args, bench: str, ours: float, baseline: str, theirs: float, **extra) -> None:
    emit(bench, "tokens_per_s", ours, baseline, theirs, **extra,
         dtype=args.dtype, new_tokens=args.new_tokens)


def report(args, ours: dict, vllm: dict, hf: dict, llama: dict | None = None) -> None:
    def tps(n: int, r) -> float:
        return n * args.new_tokens / r[0]

    def same(outs: list, base: list) -> str:
        return f"{sum(o == b for o, b in zip(outs, base))}/{len(outs)}"
    for (as_, n, mode), r in ours.items():
        where = {"programs": n, "as": as_}
        if n in hf:
            result(args, f"completion_{mode}", tps(n, r), "transformers_generate_batched",
                   tps(n, hf[n]), same_tokens_as_baseline=same(r[1], hf[n][1]), **where)
        if mode == "generate" and llama and n in llama:
            result(args, "completion_generate", tps(n, r), "llama_cpp_batched_bench",
                   tps(n, llama[n]), llama_cpp_generating_tokens_per_s=llama[n][2],
                   **where)
        if mode == "generate" and ("offline", n) in vllm:
            base = vllm[("offline", n)]
            result(args, "completion_generate", tps(n, r), "vllm_offline_generate",
                   tps(n, base), same_tokens_as_baseline=same(r[1], base[1]), **where)
        if mode == "generate" and ("server", as_, n) in vllm:
            base = vllm[("server", as_, n)]
            result(args, "completion_generate", tps(n, r), "vllm_openai_server",
                   tps(n, base), same_tokens_as_baseline=same(r[1], base[1]), **where)
        if mode in ("pred_loop", "pred_sample") and (as_, n, "generate") in ours:
            result(args, f"completion_{mode}_vs_generate", tps(n, r), "symphony_generate",
                   tps(n, ours[(as_, n, "generate")]), **where)
        if as_ == "threads" and ("processes", n, mode) in ours:
            result(args, f"completion_{mode}_threads_vs_processes", tps(n, r),
                   f"symphony_{mode}_processes", tps(n, ours[("processes", n, mode)]),
                   programs=n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="1,8,32,64", help="comma-separated N")
    ap.add_argument("--as", dest="as_", default="processes,threads",
                    help="programs as separate processes, as threads of one process, or both")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                    help="auto: the machine's best (predd.model.dtype); every system uses it")
    ap.add_argument("--modes", default="generate,pred_loop,pred_sample",
                    help="of generate, pred_loop, pred_sample")
    ap.add_argument("--baselines", default="vllm_offline,vllm_server,transformers,llama_cpp")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed runs per figure; the best is kept (noisy hosts)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: --programs 8 --new-tokens 16 --repeat 1")
    args = ap.parse_args()
    if args.quick:
        args.programs, args.new_tokens, args.repeat = "8", 16, 1
    args.programs = [int(n) for n in args.programs.split(",")]
    args.as_ = args.as_.split(",")
    args.modes = args.modes.split(",")
    args.baselines = [b for b in args.baselines.split(",") if b]
    bad = (set(args.as_) - {"processes", "threads"}) | (set(args.modes) - {
        "generate", "pred_loop", "pred_sample"}) | (set(args.baselines) - {
        "vllm_offline", "vllm_server", "transformers", "llama_cpp"})
    if bad or min(args.programs) < 1:
        ap.error(f"unknown or bad values: {sorted(bad) or args.programs}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.dtype = machine(args.dtype)

    log(f"bench: starting predd ({args.dtype}) ...")
    daemon = start_predd("--dtype", args.dtype, "--kv-pages", str(KV_PAGES),
                         "--page-size", str(PAGE_SIZE), "--max-step-tokens", str(STEP_TOKENS),
                         "--max-batch", str(max(64, *args.programs)))
    try:
        import liblip as lip
        lip.connect(daemon.addr)
        prompts = [lip.tokenize(p) for p in make_prompts(max(args.programs))]
        lip.client().close()
        lengths = sorted(map(len, prompts))
        log(f"bench: N in {args.programs} x {args.new_tokens} tokens, as {args.as_}, prompt "
            f"tokens {lengths[0]}..{lengths[-1]}")
        ours = measure_symphony(args, prompts, daemon.addr)
    finally:
        daemon.stop()
    vllm = measure_vllm(args, prompts)
    hf = measure_transformers(args, prompts) if "transformers" in args.baselines else {}
    llama = measure_llama_cpp(args, prompts) if "llama_cpp" in args.baselines else {}
    report(args, ours, vllm, hf, llama)
    return 0


if __name__ == "__main__":
    sys.exit(main())
