"""B8, Graph-of-Thought: from a shared problem prefix a task generates --branches (4)
candidate thoughts, scores each with the model, merges the --keep (2) best into one
context and refines it, for --rounds (2) rounds; as LIPs that fork, score in place and
merge caches (kv_fork, kv_extract, kv_merge), against the same application as a client
of vLLM's OpenAI server (prefix caching on) that sends the text each call needs.

A task: the shared system prompt (the solver's instructions, its chat template's system
turn, prefilled once into a cache file) and a seeded problem of ~--problem-tokens (its
user turn and the assistant's header). Each round, from the context C:

  generate   for each branch i, C + "\\nApproach i:" + a thought of --thought-tokens (32)
  score      each candidate + "\\nRate this approach from 1 (poor) to 9 (excellent).
             Score:" + --score-tokens (2); its score is the first digit generated (0 if
             none); the --keep best (ties to the lower branch) are kept
  aggregate  C + the kept candidates' "Approach" and thought, in branch order of rank
  refine     that + "\\nCombine the approaches above into one better approach:" + a
             thought of --thought-tokens; it is the next round's C

Greedy with ignore_eos, so both sides generate the same number of tokens. The two sides
feed the model the same token sequence at every call, but not the same attention: a
LIP's merged context holds each kept thought's entries as they were computed, after C
alone (a cache merge: the kept thoughts share positions and do not attend to each
other), where vLLM computes the aggregated text again, each thought after the one
before. Greedy tokens therefore agree up to the first aggregation (`same_tokens_as_
baseline` counts the first round's candidates and scores that agree) and part after it.

  symphony  --agents LIP processes; a task forks the system prompt's cache file and
            prefills the problem once; the branches of a call run as threads of the LIP
            (`generate` on forks of C), scores are generated on the candidates
            themselves, the aggregate is `kv_merge` of C and `kv_extract`s of the kept
            candidates, refine generates on it
  vllm      one /v1/completions request per step of the round with every branch's
            token ids (the whole text each needs), prefix caching on

RESULT lines `got_latency` (mean seconds per task; ratio = vLLM / Symphony) and
`got_throughput` (tasks/s; ratio = Symphony / vLLM; **target >= 1.15** at 8 tasks).

    python scripts/bench_got.py [--agents 8] [--tasks 16] [--branches 4] [--keep 2]
        [--rounds 2] [--systems symphony,vllm,vllm_nocache] [--quick]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts import bench_apps  # noqa: E402
from scripts.bench_apps import GREEDY, PAGE, fields_of, generated, lip  # noqa: E402
from scripts.bench_common import log, machine, quick_defaults, serving_flags  # noqa: E402

SYSTEM = """You are a careful problem solver who explores several approaches before \
answering. For each problem you are asked to propose an approach, to rate approaches, \
and to combine the best ones into a better approach.

When you propose an approach, state in two or three sentences what you would do first, \
what you would check, and what could go wrong. When you rate an approach, answer with a \
single digit from 1 to 9: 9 means the approach is correct, complete and efficient; 5 \
means it is plausible but misses a case; 1 means it does not solve the problem. When you \
combine approaches, keep what each does well, drop what is wrong or repeated, and state \
the combined approach as a short list of steps.

Be concrete: name the quantities, the order of the steps and the checks. Do not restate \
the problem. Do not apologise. Prefer a simple approach that is clearly right to a \
clever one that may be wrong."""

HINT = "\nApproach {}:"
SCORE = "\nRate this approach from 1 (poor) to 9 (excellent). Score:"
REFINE = "\nCombine the approaches above into one better approach:"


# ------------------------------------------------------------------ workload

@dataclass(frozen=True)
class Params:
    branches: int
    keep: int
    rounds: int
    thought_tokens: int
    score_tokens: int


@dataclass
class Workload:
    system: list[int]               # the system turn, shared by every task
    hints: list[list[int]]          # "\nApproach i:" per branch
    score: list[int]
    refine: list[int]
    digits: dict[int, int]          # token id -> the digit it is
    warmup: list[tuple[int, ...]]   # the problems: user turn and the assistant's header
    timed: list[tuple[int, ...]]

    def longest(self, p: Params) -> int:
        """The most tokens one task's context holds before a round's candidates."""
        grow = sum(sorted(map(len, self.hints))[-p.keep:]) + p.keep * p.thought_tokens + \
            len(self.refine) + p.thought_tokens
        return len(self.system) + max(map(len, self.warmup + self.timed)) + \
            (p.rounds - 1) * grow

    def peak(self, p: Params) -> int:
        """The most KV one task holds at once, in tokens: its context, each candidate's
        own entries (and a page of each copied), the aggregate, the refinement."""
        longest = self.longest(p)
        branch = max(map(len, self.hints)) + p.thought_tokens + len(self.score) + \
            p.score_tokens + PAGE
        return 2 * longest + p.branches * branch + len(self.refine) + p.thought_tokens


def make_workload(tokenizer, seed: int, warmup: int, tasks: int, branches: int,
                  problem_tokens: int) -> Workload:
    """Seeded problems tokenized by `tokenizer` (predd's: `encode`,
    `apply_chat_template`) as predd would: a chat template rendered, then encoded."""
    def chat(messages: list[dict], generation: bool) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, generation))

    system_turn = {"role": "system", "content": SYSTEM}
    system = chat([system_turn], False)
    rng = random.Random(seed)

    def problem() -> tuple[int, ...]:
        s = rng.random()
        full = bench_apps.at_least(lambda n: chat([system_turn, {
            "role": "user", "content": "Plan how to " +
            bench_apps.words(random.Random(s), n) + "."}], True),
            len(system) + problem_tokens)
        if full[:len(system)] != system:
            raise ValueError("the chat template does not extend the system turn")
        return tuple(full[len(system):])

    digits = {}
    for d in range(1, 10):
        ids = tokenizer.encode(str(d))
        if len(ids) == 1:
            digits[ids[0]] = d
    return Workload(system, [tokenizer.encode(HINT.format(i + 1)) for i in range(branches)],
                    tokenizer.encode(SCORE), tokenizer.encode(REFINE), digits,
                    [problem() for _ in range(warmup)], [problem() for _ in range(tasks)])


def score_of(out: list[int], digits: dict[int, int]) -> int:
    return next((digits[t] for t in out if t in digits), 0)


# ------------------------------------------------------------------ the application

def solve(backend, work: Workload, problem: list[int], p: Params) -> list[list[int]]:
    """One task on `backend` (LipBackend or ClientBackend): what each call generated,
    in order (per round: the candidates, their scores, the refinement)."""
    outputs: list[list[int]] = []
    ctx = backend.start(problem)
    try:
        for _ in range(p.rounds):
            cands = backend.extend([(ctx, hint) for hint in work.hints], p.thought_tokens)
            try:
                scored = backend.extend([(c, work.score) for c, _ in cands],
                                        p.score_tokens, in_place=True)
                scores = [score_of(out, work.digits) for _, out in scored]
                best = sorted(range(p.branches), key=lambda i: (-scores[i], i))[:p.keep]
                merged = backend.merge(ctx, [(scored[i][0], len(work.hints[i]) +
                                              p.thought_tokens) for i in best])
            finally:
                for c, _ in cands:
                    backend.close(c)
            backend.close(ctx)
            ctx = merged
            (ctx, refined), = backend.extend([(ctx, work.refine)], p.thought_tokens,
                                             in_place=True)
            outputs += [out for _, out in cands] + [out for _, out in scored] + [refined]
    finally:
        backend.close(ctx)
    return outputs


@dataclass
class Ctx:
    """A LIP's context: a cache and the tokens that follow it but are not in it yet
    (generate leaves its last token out)."""
    kv: object
    length: int                     # the cache's entries
    pending: list[int]


class LipBackend:
    """solve's steps as cache operations; the branches of a step are threads."""

    def __init__(self, system, pool: ThreadPoolExecutor, system_tokens: int) -> None:
        self.system, self.pool, self.system_tokens = system, pool, system_tokens
        self.computed = self.reused = 0

    def start(self, problem: list[int]) -> Ctx:
        kv = lip.kv_fork(self.system)
        try:
            self._count(lip.prefill(kv, problem))
        except BaseException:
            lip.kv_close(kv)
            raise
        return Ctx(kv, self.system_tokens + len(problem), [])

    def _count(self, cost: dict) -> None:
        self.computed += cost.get("computed", 0)
        self.reused += cost.get("reused", 0)

    def _one(self, ctx: Ctx, suffix: list[int], n: int, in_place: bool) -> tuple[Ctx, list]:
        kv = ctx.kv if in_place else lip.kv_fork(ctx.kv)
        try:
            tokens = ctx.pending + list(suffix)
            out = lip.generate(kv, tokens, max_tokens=n, sample=GREEDY, ignore_eos=True)
            ids = generated(out, n)
        except BaseException:
            if not in_place:
                lip.kv_close(kv)
            raise
        self._count(out.cost)
        return Ctx(kv, ctx.length + len(tokens) + n - 1, [ids[-1]]), ids

    def extend(self, steps: list[tuple[Ctx, list[int]]], n: int,
               in_place: bool = False) -> list[tuple[Ctx, list[int]]]:
        """Each (context, suffix) continued by n tokens: on a fork, or on the context
        itself (it is then the returned one)."""
        futures = [self.pool.submit(self._one, c, s, n, in_place) for c, s in steps]
        done, failed = [], None
        for f in futures:
            try:
                done.append(f.result())
            except BaseException as exc:  # noqa: BLE001 - re-raised after the others
                failed = failed or exc
        if failed is not None:
            if not in_place:
                for c, _ in done:
                    lip.kv_close(c.kv)
            raise failed
        return done

    def merge(self, base: Ctx, parts: list[tuple[Ctx, int]]) -> Ctx:
        """base and, of each part (a descendant of base), its `span` tokens after base's
        (base's pending tokens once, with the first part)."""
        extracts = []
        try:
            for i, (part, span) in enumerate(parts):
                start = base.length + (len(base.pending) if i else 0)
                end = base.length + len(base.pending) + span
                if end > part.length:
                    raise lip.LipError("EINVAL", f"span {span} is past the part's cache")
                extracts.append(lip.kv_extract(part.kv, [(start, end)]))
            kv = lip.kv_merge([base.kv, *extracts])
        finally:
            for e in extracts:
                lip.kv_close(e)
        return Ctx(kv, base.length + len(base.pending) + sum(s for _, s in parts), [])

    def close(self, ctx: Ctx) -> None:
        lip.kv_close(ctx.kv)


class ClientBackend:
    """solve's steps as an HTTP client: a context is its token ids, each step one
    request with every prompt."""

    def __init__(self, complete_many, system: list[int]) -> None:
        self.complete_many, self.system = complete_many, system
        self.sent = 0

    def start(self, problem: list[int]) -> list[int]:
        return self.system + list(problem)

    def extend(self, steps: list[tuple[list[int], list[int]]], n: int,
               in_place: bool = False) -> list[tuple[list[int], list[int]]]:
        prompts = [ctx + list(suffix) for ctx, suffix in steps]
        self.sent += sum(map(len, prompts))
        outs = self.complete_many(prompts, n)
        return [(prompt + out, out) for prompt, out in zip(prompts, outs)]

    def merge(self, base: list[int], parts: list[tuple[list[int], int]]) -> list[int]:
        return base + [t for part, span in parts for t in part[len(base):len(base) + span]]

    def close(self, ctx) -> None:
        pass


# ------------------------------------------------------------------ the two sides

def lip_main(system_path: str) -> None:
    """A task process: opens the system prompt's cache file, then runs the problems
    written on stdin (JSON lines) one at a time; one JSON line back per task."""
    system = lip.kv_open(system_path)
    system_tokens = lip.kv_stat(system)["tokens"]
    with ThreadPoolExecutor(16) as pool:
        def run(job: dict) -> dict:
            work = Workload([], job["hints"], job["score"], job["refine"],
                            {int(k): v for k, v in job["digits"].items()}, [], [])
            backend = LipBackend(system, pool, system_tokens)
            outs = solve(backend, work, job["problem"], fields_of(Params, job))
            return {"tokens": [t for o in outs for t in o], "calls": outs,
                    "computed": backend.computed, "reused": backend.reused}
        bench_apps.serve_jobs(run, ready=system_tokens)
    lip.kv_close(system)


def job(args, work: Workload, problem) -> dict:
    return {"problem": problem, "hints": work.hints, "score": work.score,
            "refine": work.refine, "digits": work.digits, "branches": args.branches,
            "keep": args.keep, "rounds": args.rounds,
            "thought_tokens": args.thought_tokens, "score_tokens": args.score_tokens}


def run_task_vllm(complete_many, args, work: Workload, problem) -> dict:
    backend = ClientBackend(complete_many, work.system)
    outs = solve(backend, work, problem, fields_of(Params, args))
    return {"tokens": [t for o in outs for t in o], "calls": outs, "sent": backend.sent}


def first_round_agreement(args):
    """How many of the first round's candidates and scores agree (the calls before the
    first aggregation, where both sides compute the same thing)."""
    n = 2 * args.branches

    def same(ours, theirs) -> str:
        agree = sum(a == b for x, y in zip(ours.replies, theirs.replies)
                    for a, b in zip(x["calls"][:n], y["calls"][:n]))
        return f"{agree}/{n * len(ours.replies)}"
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_apps.app_flags(ap, "tasks")
    ap.add_argument("--branches", type=int, default=4, help="candidates a round")
    ap.add_argument("--keep", type=int, default=2, help="candidates merged a round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--thought-tokens", type=int, default=32)
    ap.add_argument("--score-tokens", type=int, default=2)
    ap.add_argument("--problem-tokens", type=int, default=40)
    serving_flags(ap, "a smoke run: 2 tasks at once, 2+2 tasks, 1 round, 8-token "
                      "thoughts (each unless given)")
    args = ap.parse_args()
    quick_defaults(ap, args, {"agents": 2, "tasks": 2, "warmup": 2, "rounds": 1,
                              "thought_tokens": 8})
    bench_apps.parse_systems(ap, args)
    if min(args.agents, args.tasks, args.rounds, args.thought_tokens, args.score_tokens,
           args.keep) < 1 or not args.keep <= args.branches <= 16:
        ap.error("counts must be at least 1, and 1 <= --keep <= --branches <= 16")
    args.fanout = args.branches                 # vLLM's sequences per task
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.dtype = machine(args.dtype)

    from predd.model.loader import default_model_path
    from predd.model.tokenizer import load_tokenizer
    work = make_workload(load_tokenizer(default_model_path()), args.seed, args.warmup,
                         args.tasks, args.branches, args.problem_tokens)
    p = fields_of(Params, args)
    kv_tokens = bench_apps.kv_tokens_for(args.agents, work.peak(p))
    plens = sorted(map(len, work.timed))
    log(f"bench: system prompt {len(work.system)} tokens, problems {plens[0]}..{plens[-1]}; "
        f"{args.rounds} rounds of {args.branches} candidates of {args.thought_tokens} "
        f"tokens, {args.score_tokens}-token scores, {args.keep} kept, a refinement; "
        f"{args.agents} tasks at once, {args.warmup} warm-up + {args.tasks} timed; longest "
        f"context {work.longest(p)} tokens; KV memory {kv_tokens} tokens (predd "
        f"{-(-kv_tokens // PAGE)} pages, vLLM {bench_apps.vllm_blocks(kv_tokens)} blocks)")
    measured = bench_apps.measure(
        args, lambda: bench_apps.SymphonyRig(args, __file__, {"system": work.system},
                                             kv_tokens),
        lambda problem: job(args, work, problem),
        lambda rig, problem: run_task_vllm(rig.complete_many, args, work, problem),
        work.warmup, work.timed, kv_tokens)
    bench_apps.report("got", measured, kv_tokens, {
        "agents": args.agents, "tasks": args.tasks, "branches": args.branches,
        "keep": args.keep, "rounds": args.rounds, "thought_tokens": args.thought_tokens,
        "score_tokens": args.score_tokens, "system_tokens": len(work.system),
        "dtype": args.dtype}, same=first_round_agreement(args))
    return 0


if __name__ == "__main__":
    bench_apps.entry(lip_main, main)
