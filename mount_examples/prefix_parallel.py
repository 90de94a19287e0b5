"""Prefix caching + parallel decoding (the paper's Figure 2).

The system prompt's cache is a FILE on the KV file system, `sys_msg.kv`: the first run
prefills it, every later run (of this or any program) just opens it. Each question
forks it — copy-on-write, O(1) — in its own thread, so the system prompt is computed
once however many questions there are, and predd batches the threads' pred calls.

    python mount_examples/prefix_parallel.py "What is a cache?" "Why fork?" \
        [--sys-file sys_msg.kv] [--system TEXT] [--max-tokens N] [--no-kvfs]

`--no-kvfs` keeps the system prompt in an anonymous cache (no mount needed).
"""
from __future__ import annotations

import argparse

import liblip as lip
from common import GREEDY, chat, fail, greedy, strip_eos, system_prefix, write_report
from liblip.threads import run_threads

SYSTEM = ("You are a concise assistant for a systems course. Answer in one short "
          "sentence, in plain words, without lists or code. If a question is unclear, "
          "give the most likely reading and answer that.")


def open_system_cache(args, sys_tokens: list[int]) -> tuple[lip.KV, int]:
    """The system prompt's cache and how many tokens this run had to compute for it."""
    if args.no_kvfs:
        kv = lip.kv_create()
        return kv, lip.prefill(kv, sys_tokens)["computed"]
    kv = lip.kv_open(args.sys_file, write=True, create=True)
    have = lip.kv_tokens(kv)
    if not have:                                   # first run: prepare the file once
        return kv, lip.prefill(kv, sys_tokens)["computed"]
    if have != sys_tokens:
        fail(f"{args.sys_file} holds another prompt ({len(have)} tokens); remove it")
    return kv, 0


def answer(sys_kv: lip.KV, prompt: list[int], reused: int, max_tokens: int,
           result: dict) -> None:
    kv = lip.kv_fork(sys_kv)                       # shares every page of the prefix
    try:
        out, costs = greedy(kv, prompt[reused:], max_tokens, GREEDY)
        result.update(tokens=out, first_cost=costs[0],
                      computed=sum(c["computed"] for c in costs))
    finally:
        lip.kv_close(kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("questions", nargs="+")
    ap.add_argument("--system", default=SYSTEM)
    ap.add_argument("--sys-file", default="sys_msg.kv", help="under $KVFS_MOUNT if relative")
    ap.add_argument("--no-kvfs", action="store_true", help="anonymous cache, no file")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--report")
    args = ap.parse_args()

    sys_tokens = system_prefix(args.system)
    prompts = [chat(q, args.system) for q in args.questions]
    if any(p[:len(sys_tokens)] != sys_tokens for p in prompts):
        fail("the chat template does not render the system turn as a shared prefix")
    sys_kv, sys_computed = open_system_cache(args, sys_tokens)
    results = [{} for _ in prompts]
    try:
        run_threads(lambda i: answer(sys_kv, prompts[i], len(sys_tokens), args.max_tokens,
                                     results[i]), len(prompts))
    finally:
        lip.kv_close(sys_kv)
    for q, r in zip(args.questions, results):
        lip.send_to_user(f"Q: {q}\nA: {lip.detokenize(strip_eos(r['tokens'])).strip()}\n")
    write_report(args.report, {"system_tokens": len(sys_tokens),
                               "system_computed": sys_computed,
                               "prompts": prompts, "answers": results})


if __name__ == "__main__":
    main()
