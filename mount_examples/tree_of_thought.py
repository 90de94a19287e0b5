"""Tree of thought: branches as forks, scored, the best merged back for the answer.

The question is prefilled once. Each branch is a fork of it that samples a line of
reasoning (its own seed, in its own thread, batched by predd). A branch's score is the
mean logprob of its tokens, as predd reports them with each sampled token. The best
branch's entries are cut out of its fork (`kv_extract`) and joined to the question's
cache (`kv_merge`) — the modular reuse of Prompt Cache: no token of the question or of
the chosen thought is computed again — and the answer is decoded from the merge.

    python mount_examples/tree_of_thought.py "QUESTION" [--branches 4]
        [--thought-tokens 16] [--answer-tokens 12] [--temperature 0.8] [--seed 0]
"""
from __future__ import annotations

import argparse

import liblip as lip
from common import chat, eos_ids, greedy, strip_eos, write_report
from liblip.threads import run_threads

THINK = "Let me think step by step."
ANSWER = "\nSo the answer is"


def branch(question: lip.KV, last: int, n: int, temperature: float, seed: int,
           result: dict) -> None:
    """Sample a thought of up to n tokens after the question (cached but for `last`)."""
    kv = lip.kv_fork(question)
    out, logprobs, pending = [], [], [last]
    while len(out) < n:
        s = lip.pred_sample(kv, pending, {"temperature": temperature, "seed": seed + len(out)})
        if s.token in eos_ids():
            break
        out.append(s.token)
        logprobs.append(s.logprob)
        pending = [s.token]
    lip.prefill(kv, pending[-1:] if out else [])   # the whole thought is in the cache
    result.update(kv=kv, tokens=out, score=sum(logprobs) / max(len(logprobs), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("question")
    ap.add_argument("--branches", type=int, default=4)
    ap.add_argument("--thought-tokens", type=int, default=16)
    ap.add_argument("--answer-tokens", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--report")
    args = ap.parse_args()

    q_tokens = chat(args.question) + lip.tokenize(THINK)
    question = lip.kv_create()
    lip.prefill(question, q_tokens[:-1])
    branches = [{} for _ in range(args.branches)]
    run_threads(lambda i: branch(question, q_tokens[-1], args.thought_tokens,
                                 args.temperature, args.seed + 1000 * i, branches[i]),
                args.branches)
    best = max(range(len(branches)), key=lambda i: branches[i]["score"])
    for i, b in enumerate(branches):
        lip.send_to_user(f"[{i}] {b['score']:+.3f} {lip.detokenize(b['tokens'])!r}"
                         f"{'  <- best' if i == best else ''}\n")

    # The question's cache stops one token short (each branch computed that token in
    # its fork), so the extract starts there: question[:-1] + (last token + thought).
    n, thought = len(q_tokens), branches[best]["tokens"]
    step = lip.kv_extract(branches[best]["kv"], [(n - 1, n + len(thought))])
    merged = lip.kv_merge([question, step])
    for b in branches:
        lip.kv_close(b.pop("kv"))
    lip.kv_close(step)
    merged_tokens, merged_positions = lip.kv_tokens(merged), lip.kv_positions(merged)
    answer, costs = greedy(merged, lip.tokenize(ANSWER), args.answer_tokens)
    lip.send_to_user(f"Answer:{lip.detokenize(strip_eos(answer))}\n")
    write_report(args.report, {
        "question": q_tokens, "branches": branches, "best": best,
        "merged_tokens": merged_tokens, "merged_positions": merged_positions,
        "answer_prompt": lip.tokenize(ANSWER), "answer": answer,
        "answer_cost": costs[0]})
    lip.kv_close(merged)
    lip.kv_close(question)


if __name__ == "__main__":
    main()
