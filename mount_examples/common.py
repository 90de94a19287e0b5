"""Small helpers the example LIPs share: chat prompts, a greedy pred loop, and the
`--report FILE` JSON that tests and benchmarks read. (Text streamed to the user is
liblip's `TextStream`; a thread per branch is `liblip.threads.run_threads`; the model's
facts are `lip.info_cached()`.)

Only liblip is imported: an example is an ordinary process that needs no torch.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import liblip as lip

GREEDY = {"temperature": 0.0}   # server-side argmax: one int back, not 200 KB of logits


def chat(user: str, system: str | None = None) -> list[int]:
    """Tokens of a one-turn chat prompt, ending where the assistant's reply starts."""
    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": user}]
    return lip.chat_template(messages)


def system_prefix(system: str) -> list[int]:
    """Tokens of the system turn alone: the shared prefix of every `chat(q, system)`."""
    return lip.chat_template([{"role": "system", "content": system}],
                             add_generation_prompt=False)


def eos_ids() -> set[int]:
    return set(lip.info_cached()["eos_ids"])


def greedy(kv: lip.KV, tokens: Sequence[int], max_tokens: int,
           sample: dict | None = None) -> tuple[list[int], list[dict]]:
    """A pred loop: append `tokens`, then pick and feed one token at a time until EOS or
    `max_tokens`. Returns the tokens (a final EOS included) and each call's cost. The
    cache ends as `lip.generate` leaves it: every token but the last one is fed."""
    stop = eos_ids()
    out: list[int] = []
    costs: list[dict] = []
    pending = list(tokens)
    while len(out) < max_tokens:
        s = lip.pred_sample(kv, pending, sample or GREEDY)
        costs.append(s.cost)
        out.append(s.token)
        if s.token in stop:
            break
        pending = [s.token]
    return out, costs


def strip_eos(tokens: Sequence[int]) -> list[int]:
    return list(tokens[:-1]) if tokens and tokens[-1] in eos_ids() else list(tokens)


def write_report(path: str | None, report: dict) -> None:
    """The facts a run measured, as JSON (for tests and benchmarks)."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def fail(message: str) -> None:
    print(f"{sys.argv[0]}: {message}", file=sys.stderr)
    sys.exit(1)


def load_docs(folder: str | None, default: dict[str, str]) -> dict[str, str]:
    """NAME -> text of the NAME.txt files in `folder`, or `default` without one."""
    if not folder:
        return default
    return {f[:-4]: open(os.path.join(folder, f)).read().strip()
            for f in sorted(os.listdir(folder)) if f.endswith(".txt")}
