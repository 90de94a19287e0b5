"""Speculative decoding without a second model (prompt lookup / n-gram drafts).

The draft is what followed the last n tokens the previous time they appeared in the
prompt or the output. One multi-token `pred_sample(kv, [last] + draft, GREEDY, outputs=[0..len])`
verifies it: predd returns the greedy token after every prefix, the program keeps the
longest prefix of the draft that matches plus the model's own next token, and
`kv_truncate`s the rejected tail out of the cache. The output is exactly greedy
decoding's; only the number of round trips (and forward passes) drops.

    python mount_examples/speculative.py "Repeat exactly: ..." [--max-tokens N]
        [--draft 8] [--ngram 3]
"""
from __future__ import annotations

import argparse

import liblip as lip
from common import GREEDY, chat, eos_ids, write_report


def lookup_draft(context: list[int], ngram: int, size: int) -> list[int]:
    """The `size` tokens that followed the latest earlier occurrence of the context's
    last n tokens (longest n first); empty when nothing matches."""
    for n in range(min(ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + size]
    return []


def speculate(prompt: list[int], max_tokens: int, draft_size: int, ngram: int,
              stream: lip.TextStream | None = None) -> dict:
    eos = eos_ids()
    kv = lip.kv_create()
    out: list[int] = []

    def emit(tokens: list[int]) -> None:
        for t in tokens[:max_tokens - len(out)]:
            out.append(t)
            if t in eos:
                return
            if stream:
                stream.feed(t)

    emit([lip.pred_sample(kv, prompt, GREEDY).token])
    calls, drafted, accepted = 1, 0, 0
    while len(out) < max_tokens and out[-1] not in eos:
        base = len(prompt) + len(out) - 1       # the cache: prompt + out but the last
        draft = lookup_draft(prompt + out, ngram, min(draft_size, max_tokens - len(out) - 1))
        verdict = lip.pred_sample(kv, [out[-1]] + draft, GREEDY,
                                  outputs=list(range(len(draft) + 1)))
        calls += 1
        ok = 0
        while ok < len(draft) and draft[ok] == verdict.tokens[ok] and draft[ok] not in eos:
            ok += 1
        if ok < len(draft):
            lip.kv_truncate(kv, base + 1 + ok)   # drop the rejected tail of the draft
        drafted += len(draft)
        accepted += ok
        emit(draft[:ok] + [verdict.tokens[ok]])
    cache = lip.kv_stat(kv)["tokens"]
    lip.kv_close(kv)
    return {"tokens": out, "pred_calls": calls, "drafted": drafted, "accepted": accepted,
            "cache_tokens": cache}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draft", type=int, default=8, help="most draft tokens per call")
    ap.add_argument("--ngram", type=int, default=3, help="longest n-gram to look up")
    ap.add_argument("--report")
    args = ap.parse_args()

    prompt = chat(args.prompt)
    result = speculate(prompt, args.max_tokens, args.draft, args.ngram, lip.TextStream())
    lip.send_to_user("\n")
    write_report(args.report, {"prompt": prompt, **result})


if __name__ == "__main__":
    main()
