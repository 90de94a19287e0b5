"""B5, agent: a ReAct agent with --turns (4) tool turns, as LIPs that run their tools in
place on their own KV cache, against the same agent as a client of vLLM's OpenAI server
that sends the whole conversation again each turn.

A task is a shared system prompt (the agent's instructions and tool descriptions, ~200
tokens: the chat template's system turn) and a seeded question (~--question-tokens, its
user turn and the assistant's header). Then, --turns times: the model writes a thought
and an action of exactly --turn-tokens (32) tokens (greedy, ignore_eos), the tool runs
(it waits --tool-ms, 50 ms, as I/O would, and returns a seeded observation of
~--observation-tokens, 40), the observation joins the conversation; after the last tool
turn a final answer of --answer-tokens (32). Every system gets the same token ids
(counted with predd's tokenizer) and does the same decode work.

  symphony       --agents (8) LIP processes (this file, `lip` mode): the system prompt is
                 prefilled once into a cache file on a kvfsd mount; each task forks it
                 (`kv_fork`), `generate`s each turn on its own cache and appends only the
                 observation (the tool runs inside `lip.io_wait`): nothing sent again
  vllm           vLLM's OpenAI server, automatic prefix caching on (its default), the same
                 KV memory; one HTTP client per agent, each turn a /v1/completions
                 request with the whole conversation's token ids, the tool client-side
  vllm_nocache   the same server with prefix caching off (not run by default)

--agents closed-loop agents run --warmup tasks (untimed: the system prompt is then
cached on every side), then --tasks timed ones. RESULT lines: `agent_latency` (mean
seconds per task; ratio = baseline / Symphony: how many times lower Symphony's is;
target >= 1.5) and `agent_throughput` (tasks/s; ratio = Symphony / baseline).

    python scripts/bench_agent.py [--agents 8] [--tasks 16] [--tool-ms 50]
        [--systems symphony,vllm,vllm_nocache] [--quick]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts import bench_apps  # noqa: E402
from scripts.bench_apps import GREEDY, PAGE, VLLM_BLOCK, at_least, generated, lip, words  # noqa: E402
from scripts.bench_common import log, machine, quick_defaults, serving_flags  # noqa: E402

SYSTEM = """You are a research agent. Answer the user's question by reasoning step by \
step and calling tools; you may call several tools before you answer.

Each step has two lines. "Thought:" says what you know and what you still need. \
"Action:" calls exactly one tool as tool[argument]. The tool's result comes back on an \
"Observation:" line; read it before the next step. When you know the answer, write \
"Action: finish[answer]".

Tools:
- search[query]: searches the web and returns the best snippet for the query.
- lookup[term]: returns the sentence of the current page that mentions the term.
- calc[expression]: evaluates an arithmetic expression and returns the number.
- fetch[url]: downloads a page and returns its title and first paragraph.
- finish[answer]: ends the task with the final answer.

Rules: never invent an observation; call a tool when you are unsure; keep each thought \
short; cite the observation your answer rests on; if a tool fails, try another query \
before giving up."""


# ------------------------------------------------------------------ workload

@dataclass(frozen=True)
class Task:
    question: tuple[int, ...]                    # its user turn and the assistant's header
    observations: tuple[tuple[int, ...], ...]    # what the tool returns, one per tool turn


@dataclass
class Workload:
    system: list[int]                            # the system turn, shared by every task
    warmup: list[Task]
    timed: list[Task]

    def longest(self, turn_tokens: int, answer_tokens: int) -> int:
        """The most tokens one task's conversation holds (its system prompt included)."""
        return len(self.system) + max(
            len(t.question) + sum(map(len, t.observations)) +
            len(t.observations) * turn_tokens + answer_tokens
            for t in self.warmup + self.timed)


def make_workload(tokenizer, seed: int, warmup: int, tasks: int, turns: int,
                  question_tokens: int, observation_tokens: int) -> Workload:
    """Seeded tasks, tokenized by `tokenizer` (predd's: `encode`, `apply_chat_template`)
    as predd would: a chat template rendered, then encoded."""
    def chat(messages: list[dict], generation: bool) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(messages, generation))

    system_turn = {"role": "system", "content": SYSTEM}
    system = chat([system_turn], False)
    rng = random.Random(seed)

    def task() -> Task:
        qseed, oseed = rng.random(), rng.random()

        def whole(n: int) -> list[int]:
            q = f"Find out about {words(random.Random(qseed), n)}."
            return chat([system_turn, {"role": "user", "content": q}], True)
        full = at_least(whole, len(system) + question_tokens)
        if full[:len(system)] != system:
            raise ValueError("the chat template does not extend the system turn")
        orng = random.Random(oseed)
        observations = []
        for _ in range(turns):
            s = orng.random()
            observations.append(tuple(at_least(lambda n, s=s: tokenizer.encode(
                f"\nObservation: {words(random.Random(s), n)}.\n"), observation_tokens)))
        return Task(tuple(full[len(system):]), tuple(observations))

    return Workload(system, [task() for _ in range(warmup)], [task() for _ in range(tasks)])


def tool(task: Task, turn: int, tool_ms: float) -> list[int]:
    """The tool: waits as I/O would, returns the task's observation for this turn."""
    time.sleep(tool_ms / 1000)
    return list(task.observations[turn])


# ------------------------------------------------------------------ the LIP

def lip_main(system_path: str) -> None:
    """An agent process: opens the system prompt's cache file, then runs the tasks
    written on stdin (JSON lines) one at a time, each on a fork of it; one JSON line
    back per task. Imports liblip only: a LIP stays a small process."""
    system = lip.kv_open(system_path)
    bench_apps.serve_jobs(lambda job: run_task_lip(
        system, Task(tuple(job["question"]), tuple(map(tuple, job["observations"]))),
        job["turn_tokens"], job["answer_tokens"], job["tool_ms"]),
        ready=lip.kv_stat(system)["tokens"])
    lip.kv_close(system)


def run_task_lip(system: lip.KV, task: Task, turn_tokens: int, answer_tokens: int,
                 tool_ms: float) -> dict:
    """One task on a fork of the system prompt's cache: each turn appends only what is
    new (the question, then the last generated token and the observation)."""
    kv = lip.kv_fork(system)
    tokens: list[int] = []
    computed = reused = 0
    try:
        pending = list(task.question)
        for turn in range(len(task.observations) + 1):
            n = answer_tokens if turn == len(task.observations) else turn_tokens
            out = lip.generate(kv, pending, max_tokens=n, sample=GREEDY, ignore_eos=True)
            tokens += generated(out, n)
            computed += out.cost.get("computed", 0)
            reused += out.cost.get("reused", 0)
            if turn == len(task.observations):
                break
            with lip.io_wait(kv):          # the cache may move down a tier meanwhile
                observation = tool(task, turn, tool_ms)
            pending = [out[-1]] + observation  # generate left its last token out
    finally:
        lip.kv_close(kv)
    return {"tokens": tokens, "computed": computed, "reused": reused}


def job(args, task: Task) -> dict:
    return {"question": task.question, "observations": task.observations,
            "turn_tokens": args.turn_tokens, "answer_tokens": args.answer_tokens,
            "tool_ms": args.tool_ms}


# ------------------------------------------------------------------ the vLLM client

def run_task_vllm(complete, args, work: Workload, task: Task) -> dict:
    """The same task as a client: each turn sends the whole conversation again."""
    conversation = work.system + list(task.question)
    tokens: list[int] = []
    sent = 0
    for turn in range(len(task.observations) + 1):
        last = turn == len(task.observations)
        out = complete(conversation, args.answer_tokens if last else args.turn_tokens)
        sent += len(conversation)
        tokens += out
        if last:
            break
        conversation = conversation + out + tool(task, turn, args.tool_ms)
    return {"tokens": tokens, "sent": sent}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_apps.app_flags(ap, "agents")
    ap.add_argument("--turns", type=int, default=4, help="tool turns per task")
    ap.add_argument("--turn-tokens", type=int, default=32,
                    help="tokens of each thought and action")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--question-tokens", type=int, default=20)
    ap.add_argument("--observation-tokens", type=int, default=40)
    ap.add_argument("--tool-ms", type=float, default=50.0, help="each tool call's wait")
    serving_flags(ap, "a smoke run: 2 agents, 2+2 tasks, 8-token turns and answers "
                      "(each unless given)")
    args = ap.parse_args()
    quick_defaults(ap, args, {"agents": 2, "tasks": 2, "warmup": 2, "turn_tokens": 8,
                              "answer_tokens": 8})
    bench_apps.parse_systems(ap, args)
    if min(args.agents, args.tasks, args.turns, args.turn_tokens, args.answer_tokens) < 1:
        ap.error("counts must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.dtype = machine(args.dtype)

    from predd.model.loader import default_model_path
    from predd.model.tokenizer import load_tokenizer
    work = make_workload(load_tokenizer(default_model_path()), args.seed, args.warmup,
                         args.tasks, args.turns, args.question_tokens,
                         args.observation_tokens)
    longest = work.longest(args.turn_tokens, args.answer_tokens)
    kv_tokens = bench_apps.kv_tokens_for(args.agents, longest)
    qlens = sorted(len(t.question) for t in work.timed)
    olens = sorted(len(o) for t in work.timed for o in t.observations)
    log(f"bench: system prompt {len(work.system)} tokens, questions {qlens[0]}..{qlens[-1]},"
        f" observations {olens[0]}..{olens[-1]}, {args.turns} tool turns of "
        f"{args.turn_tokens} tokens + a {args.answer_tokens}-token answer, tools "
        f"{args.tool_ms:g} ms; {args.agents} agents, {args.warmup} warm-up + {args.tasks} "
        f"timed tasks; longest conversation {longest} tokens; KV memory {kv_tokens} "
        f"tokens (predd {-(-kv_tokens // PAGE)} pages, vLLM {bench_apps.vllm_blocks(kv_tokens)} "
        f"blocks of {VLLM_BLOCK} with its null block)")
    measured = bench_apps.measure(
        args, lambda: bench_apps.SymphonyRig(args, __file__, {"system": work.system},
                                             kv_tokens),
        lambda task: job(args, task),
        lambda rig, task: run_task_vllm(rig.complete, args, work, task),
        work.warmup, work.timed, kv_tokens)
    bench_apps.report("agent", measured, kv_tokens, {
        "agents": args.agents, "tasks": args.tasks, "turns": args.turns,
        "turn_tokens": args.turn_tokens, "answer_tokens": args.answer_tokens,
        "tool_ms": args.tool_ms, "system_tokens": len(work.system), "dtype": args.dtype})
    return 0


if __name__ == "__main__":
    bench_apps.entry(lip_main, main)
