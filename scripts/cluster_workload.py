"""The simulated clients: RAG over Zipf-popular documents, and multi-turn agent sessions.

Both are closed loops: each client sends its next run when its last is answered (after
a gap, for agents). Everything is seeded; sizes are in tokens.

* RAG: `docs` documents of `doc_tokens`; a request picks document k (rank 1..docs) with
  probability proportional to k^-alpha (Zipf; or by scripts/bench_rag.py's Pareto law,
  to compare with it), names its cache (`doc<k>`), and sends
  the document, a `question_tokens` question and decodes `answer_tokens`. The
  document's cache is what a replica keeps.
* Agent: a session starts with a `system_tokens` prompt; each turn adds a message (a
  user's or a tool's result) of uniform(lo, hi) tokens, decodes uniform(lo, hi) tokens,
  and the whole context is the session's cache (`s<client>.<n>`), grown each turn. Between
  turns the client waits an exponential think/tool gap; a session has uniform(lo, hi)
  turns, fewer if its context would pass `max_context`; its caches are dropped at its
  end and the client starts the next session at once.
"""
from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass, field

from scripts.cluster_sim import Run, Workload
from scripts.rag_workload import pareto_weights


@dataclass
class Rag(Workload):
    alpha: float = 1.0
    docs: int = 1024
    doc_tokens: int = 400
    question_tokens: int = 20
    answer_tokens: int = 32
    seed: int = 0
    pareto: bool = False         # bench_rag.py's law (rag_workload.pareto_weights) instead
    rng: random.Random = field(init=False, repr=False)
    cum: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"rag/{self.seed}/{self.alpha}")
        weights = (pareto_weights(self.alpha, self.docs) if self.pareto
                   else (k ** -self.alpha for k in range(1, self.docs + 1)))
        self.cum = list(itertools.accumulate(weights))

    @property
    def name(self) -> str:
        return f"rag a={self.alpha:g}"

    def pick(self) -> int:
        """A rank, 1..docs, by Zipf(alpha)."""
        return bisect.bisect_left(self.cum, self.rng.random() * self.cum[-1]) + 1

    def next(self, client: int, done: Run | None) -> tuple[float, Run]:
        prompt = self.doc_tokens + self.question_tokens
        return 0.0, Run(0, client, f"doc{self.pick()}", self.doc_tokens, prompt,
                        self.answer_tokens, keep=self.doc_tokens)


@dataclass
class Agent(Workload):
    system_tokens: int = 400
    message_tokens: tuple[int, int] = (50, 200)
    answer_tokens: tuple[int, int] = (16, 64)
    turns: tuple[int, int] = (4, 10)
    gap_s: float = 2.0                   # mean think/tool time between turns
    max_context: int = 4096
    seed: int = 0
    rng: random.Random = field(init=False, repr=False)
    left: dict[int, int] = field(init=False, repr=False)    # client -> turns left
    count: int = field(init=False, repr=False)               # sessions started
    name = "agent"

    def __post_init__(self) -> None:
        self.rng = random.Random(f"agent/{self.seed}")
        self.left, self.count = {}, 0

    def next(self, client: int, done: Run | None) -> tuple[float, Run]:
        if done is None or done.last:
            self.count += 1
            self.left[client] = self.rng.randint(*self.turns)
            key, context, gap = f"s{client}.{self.count}", 0, 0.0
            message = self.system_tokens + self.rng.randint(*self.message_tokens)
        else:
            self.left[client] -= 1
            key, context = done.key, done.keep
            gap = self.rng.expovariate(1 / self.gap_s)
            message = self.rng.randint(*self.message_tokens)
        answer = self.rng.randint(*self.answer_tokens)
        prompt = context + message
        room = self.max_context - (prompt + answer)
        last = self.left[client] <= 1 or room < self.message_tokens[1] + self.answer_tokens[1]
        return gap, Run(0, client, key, context, prompt, answer, keep=prompt + answer,
                        last=last)
