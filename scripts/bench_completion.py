"""Completion throughput: Symphony's three ways to decode against transformers.

32 concurrent programs (processes) x 64 new tokens, seeded prompts of ~20-60 tokens:
  (a) pred_loop    — a `pred` loop with client-side argmax over the full logits
  (b) pred_sample  — `pred` with server-side (greedy) sampling: only the token returns
  (c) generate     — predd's own decode loop, streaming
against transformers' batched greedy `generate` on the same prompts and dtype, in the
same run. Each side is timed `--repeat` times (default 3) and the best runs are
compared, since shared hosts are noisy. Prints one `RESULT {...}` line per comparison
(ratios, not timed asserts).

    python scripts/bench_completion.py [--programs 32] [--new-tokens 64] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WORDS = ("the a cache page token model program fork kernel batch prompt system user "
         "river mountain city music memory garden light window story number").split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(18, 55))) for _ in range(n)]


def program(mode: str, addr: str, tokens: list[int], n_new: int, start, out) -> None:
    """One LIP: decode n_new tokens greedily; report the ids."""
    import liblip as lip
    lip.connect(addr)
    kv = lip.kv_create()
    start.wait()
    if mode == "generate":
        ids = lip.generate(kv, tokens, max_tokens=n_new, ignore_eos=True)
    elif mode == "pred_sample":
        ids = []
        step = tokens
        for _ in range(n_new):
            ids.append(lip.pred(kv, step, sample={"temperature": 0.0}).token)
            step = [ids[-1]]
    else:
        ids = []
        dist = lip.pred(kv, tokens)
        for _ in range(n_new):
            ids.append(dist.argmax())
            if len(ids) < n_new:
                dist = lip.pred(kv, [ids[-1]])
    out.put(ids)


def run_symphony(mode: str, addr: str, prompts: list[list[int]], n_new: int) -> tuple[float, list]:
    ctx = mp.get_context("fork")
    start = ctx.Barrier(len(prompts) + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=program, args=(mode, addr, p, n_new, start, out))
             for p in prompts]
    for proc in procs:
        proc.start()
    start.wait()
    t0 = time.perf_counter()
    results = [out.get() for _ in procs]
    elapsed = time.perf_counter() - t0
    for proc in procs:
        proc.join()
    return elapsed, results


def run_transformers(prompts: list[list[int]], n_new: int, dtype: str,
                     repeat: int) -> tuple[float, list]:
    """The best of `repeat` timed runs (after a warm-up), and the generated ids."""
    import torch
    import transformers
    from predd.loader import default_model_path, load_weights
    # The same dequantised weights predd serves, in the same dtype, in transformers'
    # own LlamaForCausalLM (its GGUF loader would keep the weights packed instead).
    cfg, weights = load_weights(default_model_path(), getattr(torch, dtype))
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position, tie_word_embeddings=cfg.tie_word_embeddings)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    model.eval()
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):               # left padding, as for batched decoding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        model.generate(ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4,
                       do_sample=False, pad_token_id=2, eos_token_id=None)   # warm-up
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n_new,
                                 do_sample=False, pad_token_id=2, eos_token_id=None)
            times.append(time.perf_counter() - t0)
    print(f"bench: transformers: {' '.join(f'{t:.2f}s' for t in times)}", file=sys.stderr)
    return min(times), out[:, width:].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto: the machine's best (predd.dtype); both sides use it")
    ap.add_argument("--modes", default="pred_loop,pred_sample,generate")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timed runs per side; the best of each is compared (noisy hosts)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from predd import dtype, launch
    args.dtype, why = dtype.resolve(args.dtype, "cpu")
    flags = sorted(f for f in dtype.cpu_flags() if f.startswith(("avx", "amx")))
    print(f"bench: dtype {args.dtype} ({why}); CPU flags: {' '.join(flags)}",
          file=sys.stderr, flush=True)
    rundir = tempfile.mkdtemp(prefix="symphony-bench-")
    print(f"bench: starting predd ({args.dtype}) ...", file=sys.stderr, flush=True)
    daemon = launch.start(rundir, "--dtype", args.dtype, "--kv-pages", "1024",
                          "--max-batch", str(max(64, args.programs)))
    try:
        import liblip as lip
        lip.connect(daemon.addr)
        prompts = [lip.tokenize(p) for p in make_prompts(args.programs)]
        lip.client().close()
        lengths = sorted(map(len, prompts))
        print(f"bench: {args.programs} programs x {args.new_tokens} tokens, prompt tokens "
              f"{lengths[0]}..{lengths[-1]}", file=sys.stderr, flush=True)
        results = {}
        for mode in args.modes.split(","):
            run_symphony(mode, daemon.addr, prompts[:4], 4)                  # warm-up
            for _ in range(args.repeat):
                lip.connect(daemon.addr)
                before = lip.stats()
                lip.client().close()
                elapsed, outs = run_symphony(mode, daemon.addr, prompts, args.new_tokens)
                lip.connect(daemon.addr)
                after = lip.stats()
                lip.client().close()
                steps = after["steps"] - before["steps"]
                batch = (after["calls"] - before["calls"]) / max(steps, 1)
                if mode not in results or elapsed < results[mode][0]:
                    results[mode] = (elapsed, outs)
                print(f"bench: {mode}: {elapsed:.2f}s, {steps} steps, mean batch {batch:.1f}, "
                      f"step time {(after['step_ms'] - before['step_ms']) / max(steps, 1):.1f}"
                      f" ms, launch wait {after['launch_wait_ms'] - before['launch_wait_ms']:.0f}"
                      " ms", file=sys.stderr, flush=True)
    finally:
        daemon.stop()
    print("bench: transformers batched generate ...", file=sys.stderr, flush=True)
    base_s, base_out = run_transformers(prompts, args.new_tokens, args.dtype, args.repeat)
    total = args.programs * args.new_tokens
    base_tps = total / base_s
    hw = f"{platform.machine()} {os.cpu_count()} cpu"
    for mode, (elapsed, outs) in results.items():
        same = sum(o == b for o, b in zip(outs, base_out))
        print("RESULT " + json.dumps({
            "bench": f"completion_{mode}", "metric": "tokens_per_s",
            "symphony": round(total / elapsed, 1), "baseline": "transformers_generate_batched",
            "baseline_value": round(base_tps, 1), "ratio": round(total / elapsed / base_tps, 3),
            "same_tokens_as_baseline": f"{same}/{len(outs)}", "dtype": args.dtype,
            "programs": args.programs, "new_tokens": args.new_tokens, "hardware": hw}),
            flush=True)
    if "generate" in results and "pred_loop" in results:
        g = total / results["generate"][0]
        a = total / results["pred_loop"][0]
        print("RESULT " + json.dumps({
            "bench": "completion_pred_loop_vs_generate", "metric": "tokens_per_s",
            "symphony": round(a, 1), "baseline": "symphony_generate",
            "baseline_value": round(g, 1), "ratio": round(a / g, 3), "dtype": args.dtype}),
            flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
