"""Tensor parallel overhead: predd's step time at `--tp N` against `--tp 1`, in one run.

    python scripts/bench_tp.py [--tp 3] [--programs 1,8] [--tokens 32]

SmolLM2-135M splits 1 or 3 ways (9 query heads, 3 KV heads); on one CPU host the ranks
share its cores (predd gives each rank cores / N threads), so this measures what TP
costs here — the all-reduces, the broadcast of every step and the smaller GEMMs — not a
speed-up: TP is for a model that does not fit one device. N separate LIP processes each
generate `--tokens` tokens (scripts/bench_overhead.py's `measure`). Prints
`RESULT {json}` per N with `ratio` = per-step busy time at TP=N / at TP=1 (above 1:
slower).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)

from predd.server import launch  # noqa: E402
from scripts.bench_common import log, machine  # noqa: E402
from scripts.bench_overhead import measure  # noqa: E402


def step_ms(row: dict) -> float:
    return sum(row["per_step_ms"].values())


def run(tp: int, programs: list[int], tokens: int) -> dict[int, dict]:
    import liblip as lip
    daemon = launch.start(tempfile.mkdtemp(prefix=f"bench-tp{tp}-"), "--kv-pages", "512",
                          "--tp", str(tp), timeout=600)
    try:
        lip.connect(daemon.addr)
        rows = {n: measure(daemon.addr, n, tokens, "generate") for n in programs}
        for n, row in rows.items():
            log(f"bench: tp {tp}, {n} programs: {row['tokens_per_s']} tokens/s, "
                f"{step_ms(row):.1f} ms per step {row['per_step_ms']}")
        return rows
    finally:
        lip.client().close()
        daemon.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--programs", default="1,8")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    machine()
    programs = [int(x) for x in args.programs.split(",")]
    one = run(1, programs, args.tokens)
    many = run(args.tp, programs, args.tokens)
    for n in programs:
        print("RESULT " + json.dumps({
            "bench": "tp_overhead", "tp": args.tp, "programs": n,
            "step_ms_tp1": round(step_ms(one[n]), 2),
            f"step_ms_tp{args.tp}": round(step_ms(many[n]), 2),
            "tokens_per_s_tp1": one[n]["tokens_per_s"],
            f"tokens_per_s_tp{args.tp}": many[n]["tokens_per_s"],
            "ratio": round(step_ms(many[n]) / step_ms(one[n]), 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
