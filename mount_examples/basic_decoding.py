"""The paper's first listing: decoding is a loop in the program, not a server feature.

`pred` returns the full next-token distribution (raw logits); the program picks the
argmax itself, shows the token to the user, and feeds it back — until EOS or N tokens.

    python mount_examples/basic_decoding.py "Write a haiku about caches." [--max-tokens N]
"""
from __future__ import annotations

import argparse

import liblip as lip
from common import chat, eos_ids, write_report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompt")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--report", help="write the generated token ids here (JSON)")
    args = ap.parse_args()

    eos = eos_ids()
    stream = lip.TextStream()
    kv = lip.kv_create()
    prompt = chat(args.prompt)
    dist = lip.pred(kv, prompt)                 # prefill: the distribution after the prompt
    out: list[int] = []
    while True:
        token = dist.argmax()
        out.append(token)
        if token in eos:
            break
        stream.feed(token)                      # lip.send_to_user(text), whole characters
        if len(out) == args.max_tokens:
            break
        dist = lip.pred(kv, [token])            # append it; the next distribution
    lip.send_to_user("\n")
    write_report(args.report, {"prompt": prompt, "tokens": out,
                               "cache_tokens": lip.kv_stat(kv)["tokens"]})
    lip.kv_close(kv)


if __name__ == "__main__":
    main()
