"""B2's workload: seeded documents and questions, Pareto popularity, and the closed-loop
clients that send it to any system.

Documents are seeded word salads grown until their system turn (the chat template,
`rag_popular.prompt`) has ~--doc-tokens tokens; each request picks a document by
`pareto_ranks` and asks a fresh seeded question of ~--question-tokens tokens (its user
turn and the assistant's header). Everything is tokenized by the predd liblip is
connected to, so every system gets the same token ids.
"""
from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

WORDS = ("river mountain city music memory garden light window story number cache page "
         "token model program kernel batch system user harbor winter copper signal lantern "
         "meadow archive pilot orbit canyon violet engine ledger falcon thunder marble "
         "quartz velvet compass glacier ember tunnel beacon saddle prism harvest cobalt "
         "willow summit atlas cipher mosaic nectar orchard pebble quiver raven sketch "
         "timber umbra vessel whistle yonder zephyr").split()


@dataclass(frozen=True)
class Request:
    doc: str
    question: str
    doc_tokens: tuple[int, ...]
    question_tokens: tuple[int, ...]

    @property
    def prompt(self) -> list[int]:
        return [*self.doc_tokens, *self.question_tokens]


@dataclass
class Workload:
    docs: dict[str, str]                       # name -> text
    doc_tokens: dict[str, list[int]]
    runs: dict[float, tuple[list[Request], list[Request]]] = field(default_factory=dict)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _grow(make: Callable[[int], list[int]], target: int, start: int) -> tuple[int, list[int]]:
    """The fewest words n (from `start`, up or down) for which make(n) has at least
    `target` tokens, and those tokens."""
    n, toks = start, make(start)
    while len(toks) < target:
        n += 1
        toks = make(n)
    while n > 1 and len(shorter := make(n - 1)) >= target:
        n, toks = n - 1, shorter
    return n, toks


def pareto_weights(alpha: float, n: int) -> list[float]:
    """Rank k (1..n) weighs k^-alpha - (k+1)^-alpha: the integer part of a Pareto(alpha)
    variable, truncated at n (B2's law; the cluster simulation's too)."""
    return [k ** -alpha - (k + 1) ** -alpha for k in range(1, n + 1)]


def pareto_ranks(alpha: float, n: int, count: int, rng: random.Random) -> list[int]:
    """`count` ranks in 0..n-1 drawn by `pareto_weights`."""
    return rng.choices(range(n), pareto_weights(alpha, n), k=count)


def workload_flags(ap, clients_help: str = "closed-loop clients") -> None:
    """The flags that shape make_workload's documents, questions and answers."""
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=400)
    ap.add_argument("--question-tokens", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--clients", type=int, default=8, help=clients_help)


def make_workload(args) -> Workload:
    """Documents, and per alpha the warm-up and timed requests, all seeded, tokenized
    by the predd the process is connected to (the LIP counts the same way)."""
    import rag_popular
    rng = random.Random(args.seed)
    docs, doc_tokens = {}, {}
    for i in range(args.docs):
        seed = rng.random()

        def doc_text(n: int, seed: float = seed) -> str:
            return _words(random.Random(seed), n).capitalize() + "."
        n, toks = _grow(lambda n: rag_popular.prompt(doc_text(n), "?")[0],
                        args.doc_tokens, max(1, int(args.doc_tokens * 0.7)))
        name = f"d{i:02d}"
        docs[name], doc_tokens[name] = doc_text(n), toks
    work = Workload(docs, doc_tokens)
    order = sorted(docs)
    random.Random(args.seed + 1).shuffle(order)       # popularity rank -> document
    for alpha in args.alphas:
        arng = random.Random(f"{args.seed}/{alpha}")
        phases = []
        for count in (args.warmup, args.requests):
            reqs = []
            for rank in pareto_ranks(alpha, len(order), count, arng):
                name = order[rank]
                qseed = arng.random()

                def question(n: int, qseed: float = qseed) -> str:
                    return f"What does the document say about {_words(random.Random(qseed), n)}?"
                n, qt = _grow(lambda n: rag_popular.prompt(
                    docs[name], question(n), doc_tokens[name])[1],
                    args.question_tokens, max(1, args.question_tokens // 2 - 6))
                reqs.append(Request(name, question(n), tuple(doc_tokens[name]), tuple(qt)))
            phases.append(reqs)
        work.runs[alpha] = (phases[0], phases[1])
    return work


# ------------------------------------------------------------------ clients

@dataclass
class Run:
    seconds: float
    latencies: list[float]
    outputs: list[list[int]]
    replies: list[dict]

    def rate(self) -> float:
        return len(self.latencies) / self.seconds


def closed_loop(requests: list[Request], clients: int,
                submit: Callable[[Request], dict]) -> Run:
    """`clients` threads, each sending its next request when its last is answered;
    the requests are taken in order. Seconds from the first send to the last answer."""
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i, r in enumerate(requests):
        todo.put((i, r))
    lat: list[float] = [0.0] * len(requests)
    replies: list[dict] = [{}] * len(requests)
    errors: list[str] = []

    def client() -> None:
        while not errors:
            try:
                i, r = todo.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            try:
                replies[i] = submit(r)
            except Exception as exc:     # noqa: BLE001 - reported once, below
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            lat[i] = time.perf_counter() - t0
    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"a request failed: {errors[0]}")
    return Run(time.perf_counter() - t0, lat, [list(r["tokens"]) for r in replies], replies)
