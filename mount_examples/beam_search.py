"""Beam search as a program: one KV cache per beam, forked where a beam branches and
closed where it is pruned — so memory follows the live beams, not the search tree.

Each step asks predd for the top-k next tokens of every live beam (`pred_topk(kv, tokens, k)`,
the beams' calls in parallel threads so they batch), keeps the k best continuations by
total logprob, and ends a hypothesis at EOS. The answer is the best hypothesis by mean
logprob per token (length-normalised, as Hugging Face's default length_penalty=1).

    python mount_examples/beam_search.py "Name a color." [--width 3] [--max-tokens 10]
"""
from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import liblip as lip
from common import chat, eos_ids, strip_eos, write_report


@dataclass
class Beam:
    kv: lip.KV | None
    tokens: list[int]
    score: float                              # sum of the tokens' logprobs
    next: list[tuple[int, float]] | None = None   # top-k continuations (id, logprob)


def my_objects() -> int:
    """How many KV objects this process holds (predd's per-session accounting)."""
    me = lip.client().session["session"]
    return next(row["objects"] for row in lip.ps() if row["session"] == me)


def expand(beam: Beam, tokens: list[int], width: int) -> None:
    top = lip.pred_topk(beam.kv, tokens, width)
    beam.next = list(zip(top.ids, top.logprobs))


def search(prompt: list[int], width: int, max_tokens: int) -> tuple[list[Beam], list[dict]]:
    eos = eos_ids()
    root = Beam(lip.kv_create(), [], 0.0)
    expand(root, prompt, width)
    live, done, trace = [root], [], []
    with ThreadPoolExecutor(width) as pool:
        for _ in range(max_tokens):
            cands = [(b.score + lp, i, t) for i, b in enumerate(live) for t, lp in b.next]
            cands.sort(key=lambda c: -c[0])             # stable: ties keep beam order
            kept = cands[:width]
            children: list[Beam] = []
            for i, parent in enumerate(live):
                mine = [c for c in kept if c[1] == i]
                conts = [c for c in mine if c[2] not in eos]
                done += [Beam(None, parent.tokens + [t], s) for s, _, t in mine if t in eos]
                for n, (s, _, t) in enumerate(conts):
                    # the last child takes over the parent's cache; the others fork it
                    kv = parent.kv if n == len(conts) - 1 else lip.kv_fork(parent.kv)
                    children.append(Beam(kv, parent.tokens + [t], s))
                if not conts:
                    lip.kv_close(parent.kv)                # pruned: its pages go back
            live = children
            list(pool.map(lambda b: expand(b, b.tokens[-1:], width), live))
            trace.append({"live": len(live), "finished": len(done), "objects": my_objects()})
            if not live:
                break
    for b in live:
        lip.kv_close(b.kv)
    return done + live, trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt")
    ap.add_argument("--width", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=10)
    ap.add_argument("--report")
    args = ap.parse_args()

    prompt = chat(args.prompt)
    hyps, trace = search(prompt, args.width, args.max_tokens)
    best = max(hyps, key=lambda b: b.score / len(b.tokens))
    lip.send_to_user(lip.detokenize(strip_eos(best.tokens)) + "\n")
    write_report(args.report, {
        "prompt": prompt, "best": best.tokens, "best_score": best.score,
        "hypotheses": [{"tokens": b.tokens, "score": b.score} for b in hyps],
        "trace": trace, "objects_at_end": my_objects()})


if __name__ == "__main__":
    main()
