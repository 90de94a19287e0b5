"""predd's decode step alone: `Runner.execute` in-process for B calls of one new token
over contexts of L entries each (pages in a seeded random order, as a pool that has
been in use hands them out), best and median of --reps after 3 warm-up steps. No
server, no scheduler: what the model and the attention backend cost. The step's logits
stay where the model ran, as the engine asks for them (`execute(host=False)`, waited
for): on a GPU, from commit 96cf9a3 on, without the copy of every row to the host that
the earlier GPU step timings in docs/benchmarks.md include.

    python scripts/bench_step.py --calls 8 --context 440 [--reps 8] [--threads 2]
                                 [--attention auto|torch|cpu|flashinfer]
                                 [--linear auto|packed|...] [--device cuda --dtype float16]
                                 [--model PATH] [--cuda-graphs auto|on|off]
                                 [--shared N] [--layer-loop on|off] [--cascade on|off]
                                 [--kv-dtype auto|float32|bfloat16]
                                 [--prefill N [--prompts P]]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from predd.model.loader import default_model_path  # noqa: E402
from predd.engine.chunk import Chunk
from predd.worker.runner import Runner, RunnerConfig  # noqa: E402

PAGE = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--context", type=int, default=440)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--attention", default="auto", help="a predd --attention choice")
    ap.add_argument("--linear", default="auto", help="a predd --linear choice")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="a predd --dtype name (not auto)")
    ap.add_argument("--model", help="GGUF or Hugging Face directory (default: SmolLM2-135M)")
    ap.add_argument("--cuda-graphs", default="auto", help="a predd --cuda-graphs choice")
    ap.add_argument("--layer-loop", default="on", choices=("on", "off"),
                    help="a predd --layer-loop choice")
    ap.add_argument("--cascade", default="on", choices=("on", "off"),
                    help="a predd --cascade choice")
    ap.add_argument("--kv-dtype", default="auto",
                    help="a predd --kv-dtype choice (auto: the model's dtype here, as "
                         "--dtype is never auto)")
    ap.add_argument("--shared", type=int, default=0,
                    help="the first N entries (whole pages) are one set of pages in every "
                         "call's table: forks of one cached document (B2)")
    ap.add_argument("--prefill", type=int, default=0,
                    help="one more call a step: a fresh prompt of N tokens (a mixed step, "
                         "as a server's steps carry new requests beside decodes)")
    ap.add_argument("--prompts", type=int, default=1,
                    help="with --prefill: this many fresh prompts of that length a step")
    args = ap.parse_args()
    per = -(-(args.context + 1) // PAGE)
    each = -(-args.prefill // PAGE)
    fresh = each * args.prompts
    runner = Runner(RunnerConfig(args.model or default_model_path(), args.device, args.dtype,
                                 kv_pages=args.calls * per + fresh + 8, page_size=PAGE,
                                 threads=args.threads, attention=args.attention,
                                 linear=args.linear, cuda_graphs=args.cuda_graphs,
                                 max_batch=max(args.calls, 64),
                                 layer_loop=args.layer_loop == "on",
                                 cascade=args.cascade == "on", kv_dtype=args.kv_dtype),
                    progress=lambda msg: print(msg, file=sys.stderr)
                    if "ready" in msg or "CUDA graphs" in msg else None)
    order = np.random.default_rng(0).permutation(args.calls * per + fresh).astype(np.int32)
    tables = [order[b * per:(b + 1) * per] for b in range(args.calls)]
    shared = min(args.shared // PAGE, per - 1)
    for table in tables[1:]:
        table[:shared] = tables[0][:shared]
    chunks = [Chunk(np.array([5], np.int32), np.array([args.context], np.int32),
                    table, args.context + 1, np.array([0])) for table in tables]
    for p in range(args.prompts if args.prefill else 0):
        # the same prompts every step, their entries written again each time
        pages = order[args.calls * per + p * each:args.calls * per + (p + 1) * each]
        chunks.append(Chunk((np.arange(args.prefill, dtype=np.int32) + p) % 1000 + 100,
                            np.arange(args.prefill, dtype=np.int32), pages,
                            args.prefill, np.array([args.prefill - 1])))
    with torch.inference_mode():
        for _ in range(3):
            runner.execute(chunks, host=False)   # as the engine asks: logits left there
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            runner.execute(chunks, host=False)   # as the engine asks: logits left there
            times.append(time.perf_counter() - t0)
    times.sort()
    graphs = f", CUDA graphs ({runner.graphs.replays} replays)" if runner.graphs else ""
    print(f"{runner.backend.name}, {runner.linear}{graphs}, {args.device} {args.dtype}: "
          f"calls {args.calls} context {args.context} (shared {shared * PAGE})"
          f"{f' + {args.prompts} prompt(s) of {args.prefill}' if args.prefill else ''}: "
          f"best {times[0] * 1e3:.1f} ms, "
          f"median {times[len(times) // 2] * 1e3:.1f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
