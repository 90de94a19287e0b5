"""B6, per-token overhead: programs that decide every token against predd's own loop, on a
model whose step is as fast as a GPU's.

A model of SmolLM2's vocabulary and tokenizer but two layers of width 64
(scripts/gguf_random.py --shape tiny, random weights, written once into the bench cache)
steps in a millisecond or two on any CPU, so what a program loses to the built-in loop
is predd's and liblip's work per call — the round trip, the scheduling, the replies —
not the model. N programs (N in --programs, default 1,8,16), each a separate process,
decode --new-tokens (64) greedy tokens from a seeded prompt:
  generate     — predd's own loop
  pred_sample  — a `pred_sample` per token (predd's speculative continuation on)
  pred_loop    — a `pred` per token, the program taking the argmax of the logits
with predd's speculative continuation on (`--speculate on`; its default on a CPU is off),
then `generate` and the `pred_sample` loop on a predd with `--speculate off`; each loop
is compared with `generate` on the same predd. Each figure is the best of
--repeat runs; prints one `RESULT {...}` line per N and loop: its tokens/s over
generate's (the target: pred_sample >= 0.95, pred_loop >= 0.85), with predd's step time
and its CPU a request. --context N makes each prompt N tokens (its own repeated): what a
call costs predd beside a long cache (an agent's history), where any work that walks a
cache's pages a step shows.

    python scripts/bench_loop.py [--programs 1,8,16] [--new-tokens 64] [--repeat 3]
                                 [--context N]
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts import gguf_random  # noqa: E402
from scripts.bench_common import log, result, start_predd  # noqa: E402
from scripts.bench_llama_cpp import bench_dir  # noqa: E402
from scripts.bench_completion import make_prompts, measure_symphony  # noqa: E402

KV_PAGES, PAGE_SIZE = 2048, 16


def tiny_model() -> str:
    """The tiny model's GGUF in the bench cache, written the first time."""
    from predd.model.loader import default_model_path
    path = os.path.join(bench_dir(), "tiny-random.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        gguf_random.write(path + ".part", gguf_random.SHAPES["tiny"], default_model_path())
        os.replace(path + ".part", path)
    return path


def long_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    """Each prompt repeated to exactly n tokens (--context)."""
    return [(p * -(-n // len(p)))[:n] for p in prompts]


def measure(model: str, args, modes: list[str], *flags: str) -> dict:
    """(mode, N) -> (tokens/s, ms a step) on a predd started with `flags`."""
    import liblip as lip
    # room for every program's cache at once, beside what the default pool holds
    pages = max(KV_PAGES, max(args.programs) * -(-(args.context + args.new_tokens + 1)
                                                 // PAGE_SIZE) * 2)
    daemon = start_predd("--model", model, "--kv-pages", str(pages), "--page-size",
                         str(PAGE_SIZE), "--max-batch", str(max(64, *args.programs)), *flags)
    try:
        lip.connect(daemon.addr)
        prompts = [lip.tokenize(p) for p in make_prompts(max(args.programs))]
        if args.context:
            prompts = long_prompts(prompts, args.context)
        before = lip.stats()
        lip.client().close()
        runs = SimpleNamespace(as_=["processes"], programs=args.programs, modes=modes,
                               new_tokens=args.new_tokens, repeat=args.repeat)
        best = measure_symphony(runs, prompts, daemon.addr)
        lip.connect(daemon.addr)
        after = lip.stats()
        lip.client().close()
    finally:
        daemon.stop()
    spec = after.get("speculation") or {}
    requests = max(after["requests"] - before["requests"], 1)
    steps = max(after["steps"] - before["steps"], 1)
    cpu = {k: after["time_ms"][k] - before["time_ms"][k] for k in ("requests_cpu", "step_cpu")}
    log(f"bench: predd {' '.join(flags) or '(defaults)'}: speculation {spec}, step "
        f"{(after['step_ms'] - before['step_ms']) / steps:.2f} ms on average; predd's CPU: "
        f"{cpu['requests_cpu'] * 1e3 / requests:.0f} us a request in the turns that take "
        f"them in, {cpu['step_cpu'] / steps:.2f} ms a step outside its forward "
        "(stats.time_ms.requests_cpu and step_cpu; every mode and N together; each run's "
        "line has its own split)")
    return {(mode, n): args.new_tokens * n / best[("processes", n, mode)][0]
            for mode in modes for n in args.programs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", default="1,8,16", help="comma-separated N")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--context", type=int, default=0, metavar="N",
                    help="each prompt N tokens (default: the seeded prompts as they are)")
    ap.add_argument("--quick", action="store_true", help="--programs 8 --repeat 1")
    args = ap.parse_args()
    if args.quick:
        args.programs, args.repeat = "8", 1
    args.programs = [int(n) for n in args.programs.split(",")]
    model = tiny_model()
    on = measure(model, args, ["generate", "pred_sample", "pred_loop"], "--speculate", "on")
    off = measure(model, args, ["generate", "pred_sample"], "--speculate", "off")
    for n in args.programs:   # each loop against generate on the same predd
        for name, tps, base in (
                ("pred_sample", on[("pred_sample", n)], on[("generate", n)]),
                ("pred_loop", on[("pred_loop", n)], on[("generate", n)]),
                ("pred_sample_no_speculation", off[("pred_sample", n)], off[("generate", n)])):
            result("B6", f"{name}_vs_generate_x{n}", tps, "symphony_generate", base,
                   programs=n, tokens=args.new_tokens,
                   **({"context": args.context} if args.context else {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
