"""A green-list watermark (Kirchenbauer et al., 2023) and its detector, as a program.

Generating: before each token, a hash of the key and the previous token seeds a
pseudo-random "green list" of γ·V tokens; the program adds δ to their logits and
samples. The raw logits `pred` returns are what make this possible without a server
feature. Detecting needs no model: tokenize the text, count the tokens that are green
given their predecessor, and compare with the γ·T expected by chance (a z-score).

    python mount_examples/watermark.py generate PROMPT [--runs N] [--seed S]
        [--delta 2] [--gamma 0.25] [--key 15485863] [--max-tokens 40] [--out DIR]
    python mount_examples/watermark.py detect FILE...   # one text per file; prints z
"""
from __future__ import annotations

import argparse
import math
import os
from functools import lru_cache

import numpy as np

import liblip as lip
from common import chat, eos_ids, write_report
from liblip.threads import run_threads

KEY = 15485863   # the paper's hash key (a prime)


@lru_cache(maxsize=4096)
def green_list(prev: int, key: int, gamma: float, vocab: int) -> np.ndarray:
    """Boolean [vocab]: the tokens that are green after `prev`."""
    perm = np.random.default_rng([key, prev]).permutation(vocab)
    green = np.zeros(vocab, dtype=bool)
    green[perm[:int(gamma * vocab)]] = True
    return green


def z_score(tokens: list[int], prev: int, key: int, gamma: float) -> tuple[float, int, int]:
    """(z, green count, scored count) of `tokens`, the first one following `prev`."""
    vocab = lip.info_cached()["vocab_size"]
    hits = 0
    for t in tokens:
        hits += bool(green_list(prev, key, gamma, vocab)[t])
        prev = t
    n = len(tokens)
    z = (hits - gamma * n) / math.sqrt(n * gamma * (1 - gamma)) if n else 0.0
    return z, hits, n


def generate(prompt_kv: lip.KV, prompt: list[int], seed: int, delta: float, gamma: float,
             key: int, max_tokens: int, min_tokens: int) -> list[int]:
    """One sample after `prompt`, cached in `prompt_kv` but for its last token."""
    eos = sorted(eos_ids())
    vocab = lip.info_cached()["vocab_size"]
    rng = np.random.default_rng(seed)
    kv = lip.kv_fork(prompt_kv)
    out: list[int] = []
    dist = lip.pred(kv, prompt[-1:])
    try:
        while len(out) < max_tokens:
            prev = out[-1] if out else prompt[-1]
            logits = dist.logits.astype(np.float64)
            logits[green_list(prev, key, gamma, vocab)] += delta
            if len(out) < min_tokens:
                logits[eos] = -np.inf
            p = np.exp(logits - logits.max())
            token = int(rng.choice(vocab, p=p / p.sum()))
            out.append(token)
            if token in eos:
                break
            dist = lip.pred(kv, [token])
    finally:
        lip.kv_close(kv)
    return out


def cmd_generate(args) -> None:
    prompt = chat(args.prompt)
    prompt_kv = lip.kv_create()                 # the prompt is computed once, then forked
    lip.prefill(prompt_kv, prompt[:-1])
    texts: list[str] = [""] * args.runs
    tokens: list[list[int]] = [[] for _ in range(args.runs)]

    def run(i: int) -> None:
        tokens[i] = generate(prompt_kv, prompt, args.seed + i, args.delta, args.gamma, args.key,
                             args.max_tokens, args.min_tokens)
        body = [t for t in tokens[i] if t not in eos_ids()]
        texts[i] = lip.detokenize(body)

    run_threads(run, args.runs)
    lip.kv_close(prompt_kv)
    for i, text in enumerate(texts):
        if args.out:
            with open(os.path.join(args.out, f"{args.seed + i}.txt"), "w") as f:
                f.write(text)
        else:
            lip.send_to_user(text + "\n")
    write_report(args.report, {"prompt": prompt, "runs": [
        {"tokens": t, "text": x, "z": z_score([u for u in t if u not in eos_ids()],
                                               prompt[-1], args.key, args.gamma)[0]}
        for t, x in zip(tokens, texts)]})


def cmd_detect(args) -> None:
    for path in args.files:
        with open(path) as f:
            tokens = lip.tokenize(f.read())
        z, hits, n = z_score(tokens[1:], tokens[0], args.key, args.gamma) if tokens \
            else (0.0, 0, 0)
        verdict = "watermarked" if z > args.threshold else "not watermarked"
        print(f"{path}\tz={z:.2f}\tgreen={hits}/{n}\t{verdict}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gamma", type=float, default=0.25, help="green fraction of the vocab")
    ap.add_argument("--key", type=int, default=KEY)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate")
    g.add_argument("prompt")
    g.add_argument("--delta", type=float, default=2.0, help="bias added to green logits")
    g.add_argument("--runs", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-tokens", type=int, default=40)
    g.add_argument("--min-tokens", type=int, default=16, help="EOS is masked before this")
    g.add_argument("--out", help="write each text to OUT/SEED.txt instead of stdout")
    g.add_argument("--report")
    d = sub.add_parser("detect")
    d.add_argument("files", nargs="+")
    d.add_argument("--threshold", type=float, default=4.0)
    args = ap.parse_args()
    cmd_generate(args) if args.cmd == "generate" else cmd_detect(args)


if __name__ == "__main__":
    main()
