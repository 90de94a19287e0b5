"""The cpu attention kernel alone, as a step calls it: `decodes` decode rows over
`context` entries each and one chunk of `chunk` new tokens after `past` entries, on
SmolLM2-135M's shape (9 query heads, 3 kv heads, head_dim 64, pages of 16, bfloat16),
30 layers; best of --reps, with the chunk in blocks of 16 query vectors (on AMX tiles,
or by bf16 dot products without them) and with every row on the row kernel
(predd/kernels/csrc/paged_attention.c, attention_tiles.c). With --shared N
the decodes' first N entries (whole pages) are the same pages, forks of one document
(B2), and a third figure has them attended together in blocks (predd --cascade).
With --cold MB each layer reads its own pool, and MB of other memory between layers,
as in a step (the weights stream through the caches); without it the one pool stays
in cache.

    python scripts/bench_attention.py [--decodes 7] [--chunk 41] [--past 400]
        [--context 440] [--shared 0] [--reps 20] [--threads 2] [--cold 0]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from predd.kernels import cpu_kernels, library  # noqa: E402

PAGE, KV_HEADS, HEADS, HEAD_DIM, LAYERS = 16, 3, 9, 64, 30


def step(kernels: library.Kernels, calls: list[tuple[int, int]], reps: int,
         shared: int = 0, cascade: bool = False, cold: float = 0.0) -> float:
    """Best ms for LAYERS layers of `calls` (new tokens, entries before them), each call's
    pages scattered over the pool; the decodes' first `shared` pages the same ones, read
    together in blocks with `cascade`. With `cold` (MB), each layer has its own pool and
    that much other memory is read between layers, as a step's weights are (its time,
    measured alone, taken away): the pages come from memory, not from the caches."""
    tables = [-(-(past + n) // PAGE) for n, past in calls]
    pools = [torch.randn(sum(tables) + 8, 2, PAGE, KV_HEADS, HEAD_DIM).to(torch.bfloat16)
             for _ in range(LAYERS if cold else 1)]
    other = torch.ones(int(cold * 2**20) // 4) if cold else None
    order = np.random.default_rng(0).permutation(len(pools[0]))[:sum(tables)].astype(np.int32)
    first = 0
    for (n, _), count in zip(calls, tables):
        if n == 1 and first:
            order[first:first + shared] = order[:shared]
        first += count
    rows = sum(n for n, _ in calls)
    q = torch.randn(rows, HEADS, HEAD_DIM).to(torch.bfloat16)
    out = torch.empty_like(q)
    token, pages, visible = [], [], []
    start = 0
    for (n, past), count in zip(calls, tables):
        for j in range(n):
            token.append(len(token))
            pages.append(start)
            visible.append(past + j + 1)
        start += count
    run = kernels.bind_attention(order, np.array(token, np.int64), np.array(pages, np.int64),
                                 np.array(visible, np.int64), max(visible),
                                 call_rows=np.array([n for n, _ in calls], np.int64),
                                 page_size=PAGE if cascade else 0)
    best = reading = float("inf")
    for _ in range(reps):
        began = time.perf_counter()
        for layer in range(LAYERS):
            run(q, out, pools[layer % len(pools)])
            if other is not None:
                other.sum()
        best = min(best, time.perf_counter() - began)
        if other is not None:
            began = time.perf_counter()
            for _ in range(LAYERS):
                other.sum()
            reading = min(reading, time.perf_counter() - began)
    return (best - (reading if other is not None else 0.0)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=7)
    ap.add_argument("--chunk", type=int, default=41)
    ap.add_argument("--past", type=int, default=400)
    ap.add_argument("--context", type=int, default=440)
    ap.add_argument("--shared", type=int, default=0,
                    help="the decodes' first N entries (whole pages) are the same pages")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cold", type=float, default=0.0, metavar="MB",
                    help="a pool per layer and MB of other memory read between layers "
                         "(a step's weights: ~2.2 MB a layer for SmolLM2 in Q4_1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    problem = cpu_kernels.problem()
    if problem:
        sys.exit(f"bench_attention: predd's kernels are unavailable here: {problem}")
    kernels = cpu_kernels.kernels()
    calls = [(1, args.context - 1)] * args.decodes + ([(args.chunk, args.past)]
                                                      if args.chunk else [])
    shared = min(args.shared, args.context - 1) // PAGE
    shape = (f"{args.decodes} decodes over {args.context} (the first {shared * PAGE} shared), "
             f"a chunk of {args.chunk} after {args.past}")
    kind = kernels.attention_blocks
    limits = kernels.block_limits
    if kind:
        how = "on AMX tiles" if kind == "tiles" else "in blocks by dot products (no AMX)"
        if shared:
            ms = step(kernels, calls, args.reps, shared, cascade=True, cold=args.cold)
            print(f"{shape}: {ms:.2f} ms, the chunk and the shared pages {how} (groups of "
                  f"{limits.shared_rows} rows and {limits.shared_pages} pages or more)")
        ms = step(kernels, calls, args.reps, shared, cold=args.cold)
        print(f"{shape}: {ms:.2f} ms, the chunk {how} (calls of {limits.rows} rows or more)")
    else:
        print("bench_attention: no attention blocks here (bf16 dot products or AMX tiles): "
              "the row kernel only")
    kernels.use_bf16_tiles(False)
    try:
        ms = step(kernels, calls, args.reps, shared, cold=args.cold)
        print(f"{shape}: {ms:.2f} ms, every row on the row kernel")
    finally:
        kernels.use_bf16_tiles(True)


if __name__ == "__main__":
    main()
