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
import contextlib
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
import liblip as lip  # noqa: E402
from scripts import bench_vllm  # noqa: E402
from scripts.bench_common import (Mount, log, machine, percentile,  # noqa: E402
                                  quick_defaults, result, serving_flags, start_predd)
from scripts.rag_workload import WORDS, Run, closed_loop  # noqa: E402

PAGE = 16                     # predd's page, in tokens
VLLM_BLOCK = 32               # the smallest block vLLM's CPU attention takes
GREEDY = {"temperature": 0.0}
TIMEOUT_S = 900
SYSTEMS = ("symphony", "vllm", "vllm_nocache")

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


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def at_least(make, target: int) -> list[int]:
    """make(n) (tokens of a text of n words) for the fewest n that make `target`."""
    n = 1
    while len(toks := make(n)) < target:
        n += 1
    return toks


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
    print(json.dumps({"ready": lip.kv_stat(system)["tokens"]}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        task = Task(tuple(job["question"]), tuple(map(tuple, job["observations"])))
        try:
            reply = run_task_lip(system, task, job["turn_tokens"],
                                 job["answer_tokens"], job["tool_ms"])
        except lip.LipError as exc:
            reply = {"error": exc.code, "message": str(exc)}
        print(json.dumps(reply), flush=True)
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
            if len(out) != n:
                raise lip.LipError("EIO", f"generate returned {len(out)} tokens, not {n}")
            tokens += out
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


# ------------------------------------------------------------------ systems

class Agents:
    """--agents LIP processes; a task goes to whichever is free."""

    def __init__(self, args, env: dict, system_path: str) -> None:
        from predd.server.launch import die_with_parent
        self.args = args
        self.procs: list[subprocess.Popen] = []
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        try:
            for _ in range(args.agents):
                self.procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "lip", system_path],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                    cwd=ROOT, preexec_fn=die_with_parent))
            for proc in self.procs:
                ready = json.loads(proc.stdout.readline() or "{}")
                if "ready" not in ready:
                    raise RuntimeError(f"an agent LIP did not start (exit {proc.poll()})")
                self.free.put(proc)
        except BaseException:
            self.close()
            raise

    def submit(self, task: Task) -> dict:
        proc = self.free.get(timeout=TIMEOUT_S)
        try:
            proc.stdin.write(json.dumps({
                "question": task.question, "observations": task.observations,
                "turn_tokens": self.args.turn_tokens,
                "answer_tokens": self.args.answer_tokens,
                "tool_ms": self.args.tool_ms}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        finally:
            self.free.put(proc)
        if not line:
            raise RuntimeError(f"an agent LIP exited {proc.poll()}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"{reply['error']}: {reply.get('message')}")
        return reply

    def close(self) -> None:
        """End of input: each LIP frees its handles and exits (else it is stopped)."""
        from predd.server.launch import terminate
        for proc in self.procs:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
            if terminate(proc, 10.0) != 0:
                log(f"bench: an agent LIP exited {proc.returncode}")
            proc.stdout.close()


class SymphonyRig:
    """predd with `kv_tokens` of KV memory, kvfsd on a private mount, the system prompt
    prefilled once into `system.kv` there, and the agent LIPs."""

    def __init__(self, args, work: Workload, kv_tokens: int) -> None:
        self.args = args
        self.pages = -(-kv_tokens // PAGE)
        self.daemon = start_predd("--dtype", args.dtype, "--kv-pages", str(self.pages),
                                  "--max-step-tokens", str(args.step_tokens))
        self.mount = self.agents = None
        try:
            self.mount = Mount(self.daemon.addr)
            lip.connect(self.daemon.addr)
            system_path = os.path.join(self.mount.path, "system.kv")
            kv = lip.kv_create()
            cost = lip.prefill(kv, work.system)
            lip.kv_save(kv, system_path)
            lip.kv_close(kv)
            log(f"bench: symphony: the system prompt prefilled once ({cost['computed']} "
                f"tokens) into {system_path}")
            env = {**os.environ, "PREDD_ADDR": self.daemon.addr,
                   "KVFS_MOUNT": self.mount.path,
                   "PYTHONPATH": os.path.dirname(os.path.dirname(lip.__file__))}
            self.agents = Agents(args, env, system_path)
        except BaseException:
            self.close()
            raise

    def run(self, tasks: list[Task]) -> Run:
        before = lip.stats()
        run = closed_loop(tasks, self.args.agents, self.agents.submit)
        after = lip.stats()
        steps = after["steps"] - before["steps"]
        log(f"bench: symphony, {len(tasks)} tasks: {run.seconds:.1f}s, "
            f"{run.rate():.3f} tasks/s, mean {sum(run.latencies) / len(tasks):.2f}s p50 "
            f"{percentile(run.latencies, 50):.2f}s p99 {percentile(run.latencies, 99):.2f}s;"
            f" {sum(r['computed'] for r in run.replies) / len(tasks):.0f} tokens computed "
            f"and {sum(r['reused'] for r in run.replies) / len(tasks):.0f} reused a task; "
            f"predd {steps} steps, mean batch "
            f"{(after['calls'] - before['calls']) / max(steps, 1):.1f}, step "
            f"{(after['step_ms'] - before['step_ms']) / max(steps, 1):.0f} ms")
        return run

    def close(self) -> None:
        if self.agents is not None:
            self.agents.close()
        with contextlib.suppress(Exception):
            lip.client().close()
        if self.mount is not None:
            self.mount.close()
        self.daemon.stop()


class VllmRig:
    """vLLM's OpenAI server with `kv_tokens` of KV memory; an agent is a client thread
    that sends the whole conversation each turn."""

    def __init__(self, args, work: Workload, kv_tokens: int, prefix_caching: bool) -> None:
        self.args, self.work, self.prefix_caching = args, work, prefix_caching
        self.blocks = kv_tokens // VLLM_BLOCK + 1          # and one for its null block
        self.server = bench_vllm.Server(args.dtype, self.blocks * VLLM_BLOCK, args.agents,
                                        args.step_tokens, log=log,
                                        prefix_caching=prefix_caching,
                                        block_tokens=VLLM_BLOCK)
        self.local = threading.local()

    def complete(self, prompt: list[int], n: int) -> list[int]:
        import httpx
        if not hasattr(self.local, "client"):          # one connection per agent
            self.local.client = httpx.Client(base_url=self.server.url, timeout=TIMEOUT_S)
        reply = self.local.client.post("/v1/completions",
                                       json=bench_vllm.completion_request(prompt, n))
        reply.raise_for_status()
        ids = bench_vllm.completion_ids(reply.json())
        if len(ids) != n:
            raise RuntimeError(f"vLLM returned {len(ids)} ids, not {n}")
        return ids

    def submit(self, task: Task) -> dict:
        conversation = self.work.system + list(task.question)
        tokens: list[int] = []
        sent = 0
        for turn in range(len(task.observations) + 1):
            last = turn == len(task.observations)
            out = self.complete(conversation,
                                self.args.answer_tokens if last else self.args.turn_tokens)
            sent += len(conversation)
            tokens += out
            if last:
                break
            conversation = conversation + out + tool(task, turn, self.args.tool_ms)
        return {"tokens": tokens, "sent": sent}

    def run(self, tasks: list[Task]) -> tuple[Run, float]:
        """(the timed run, the prompt tokens it computed per task: those vLLM's prefix
        cache did not hold)."""
        before = self.server.metrics()
        run = closed_loop(tasks, self.args.agents, self.submit)
        after = self.server.metrics()
        hits = after.get("vllm:prefix_cache_hits_total", 0) - \
            before.get("vllm:prefix_cache_hits_total", 0)
        sent = sum(r["sent"] for r in run.replies)
        system = len(self.work.system) * (self.args.turns + 1) * len(tasks)
        log(f"bench: {self.name()} ({self.blocks} blocks), {len(tasks)} tasks: "
            f"{run.seconds:.1f}s, {run.rate():.3f} tasks/s, mean "
            f"{sum(run.latencies) / len(tasks):.2f}s p50 {percentile(run.latencies, 50):.2f}s"
            f" p99 {percentile(run.latencies, 99):.2f}s; prompt tokens sent {sent} "
            f"(system prompts alone {system}), found in its prefix cache {hits:.0f}")
        return run, (sent - hits) / len(tasks)

    def name(self) -> str:
        return "vllm" if self.prefix_caching else "vllm_nocache"

    def close(self) -> None:
        self.server.stop()


# ------------------------------------------------------------------ run and report

def measure(args, work: Workload, kv_tokens: int) -> dict:
    """system -> (Run, extra) for each system that ran. vLLM's servers run one at a
    time, each while predd idles (idle, neither takes CPU from the other)."""
    out: dict = {}
    with contextlib.ExitStack() as stack:
        rig = stack.enter_context(contextlib.closing(SymphonyRig(args, work, kv_tokens))) \
            if "symphony" in args.systems else None
        for name in [s for s in args.systems if s.startswith("vllm")]:
            try:
                base = VllmRig(args, work, kv_tokens, prefix_caching=name == "vllm")
            except bench_vllm.Unavailable as e:
                log(f"bench: vLLM baseline unavailable: {str(e).splitlines()[0]}")
                break
            try:
                closed_loop(work.warmup, args.agents, base.submit)
                out[name] = base.run(work.timed)
            except Exception as e:      # noqa: BLE001 - the bench goes on without it
                log(f"bench: {name} failed: {e}; going on without it "
                    f"(log {base.server.log_path})")
            finally:
                base.close()
        if rig is not None:
            closed_loop(work.warmup, args.agents, rig.agents.submit)
            out["symphony"] = (rig.run(work.timed), None)
    return out


def summary(run: Run) -> dict:
    return {"mean_s": sum(run.latencies) / len(run.latencies),
            "p50_s": round(percentile(run.latencies, 50), 3),
            "p99_s": round(percentile(run.latencies, 99), 3)}


def report(args, work: Workload, kv_tokens: int, measured: dict) -> None:
    common = {"agents": args.agents, "tasks": args.tasks, "turns": args.turns,
              "turn_tokens": args.turn_tokens, "answer_tokens": args.answer_tokens,
              "tool_ms": args.tool_ms, "system_tokens": len(work.system),
              "kv_tokens": kv_tokens, "dtype": args.dtype}
    if "symphony" not in measured:
        return
    run, _ = measured["symphony"]
    ours = summary(run)
    mine = {"symphony_p50_s": ours["p50_s"], "symphony_p99_s": ours["p99_s"],
            "symphony_computed_per_task": round(
                sum(r["computed"] for r in run.replies) / len(run.replies), 1)}
    baselines = {"vllm": "vllm_prefix_caching", "vllm_nocache": "vllm_no_prefix_caching"}
    for name, label in baselines.items():
        if name not in measured:
            continue
        base, computed = measured[name]
        theirs = summary(base)
        same = sum(a == b for a, b in zip(run.outputs, base.outputs))
        extra = {**mine, "baseline_p50_s": theirs["p50_s"], "baseline_p99_s": theirs["p99_s"],
                 "baseline_computed_prompt_per_task": round(computed, 1),
                 "vllm_blocks": kv_tokens // VLLM_BLOCK + 1, "vllm_block_tokens": VLLM_BLOCK,
                 "same_tokens_as_baseline": f"{same}/{len(run.outputs)}", **common}
        result("agent_latency", "seconds_per_task", ours["mean_s"], label, theirs["mean_s"],
               ratio=round(theirs["mean_s"] / ours["mean_s"], 3),
               ratio_is="baseline / symphony", **extra)
        result("agent_throughput", "tasks_per_s", run.rate(), label, base.rate(),
               ratio_is="symphony / baseline", **extra)
    if not any(name in measured for name in baselines):
        result("agent_latency", "seconds_per_task", ours["mean_s"], "none", 0.0, **mine,
               **common)
        result("agent_throughput", "tasks_per_s", run.rate(), "none", 0.0, **mine, **common)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=8, help="concurrent agents")
    ap.add_argument("--tasks", type=int, default=16, help="timed tasks")
    ap.add_argument("--warmup", type=int, default=8, help="untimed tasks first")
    ap.add_argument("--turns", type=int, default=4, help="tool turns per task")
    ap.add_argument("--turn-tokens", type=int, default=32,
                    help="tokens of each thought and action")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--question-tokens", type=int, default=20)
    ap.add_argument("--observation-tokens", type=int, default=40)
    ap.add_argument("--tool-ms", type=float, default=50.0, help="each tool call's wait")
    ap.add_argument("--systems", default="symphony,vllm",
                    help=f"of {','.join(SYSTEMS)}")
    serving_flags(ap, "a smoke run: 2 agents, 2+2 tasks, 8-token turns and answers "
                      "(each unless given)")
    args = ap.parse_args()
    quick_defaults(ap, args, {"agents": 2, "tasks": 2, "warmup": 2, "turn_tokens": 8,
                              "answer_tokens": 8})
    args.systems = args.systems.split(",")
    if set(args.systems) - set(SYSTEMS) or min(args.agents, args.tasks, args.turns,
                                                  args.turn_tokens, args.answer_tokens) < 1:
        ap.error(f"bad --systems or counts: {args.systems}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.dtype = machine(args.dtype)

    from predd.model.loader import default_model_path
    from predd.model.tokenizer import load_tokenizer
    work = make_workload(load_tokenizer(default_model_path()), args.seed, args.warmup,
                         args.tasks, args.turns, args.question_tokens,
                         args.observation_tokens)
    longest = work.longest(args.turn_tokens, args.answer_tokens)
    # every agent's whole conversation, system prompt included, in whole vLLM blocks:
    # no side ever evicts or preempts, with or without sharing the system prompt
    kv_tokens = args.agents * -(-longest // VLLM_BLOCK) * VLLM_BLOCK
    qlens = sorted(len(t.question) for t in work.timed)
    olens = sorted(len(o) for t in work.timed for o in t.observations)
    log(f"bench: system prompt {len(work.system)} tokens, questions {qlens[0]}..{qlens[-1]},"
        f" observations {olens[0]}..{olens[-1]}, {args.turns} tool turns of "
        f"{args.turn_tokens} tokens + a {args.answer_tokens}-token answer, tools "
        f"{args.tool_ms:g} ms; {args.agents} agents, {args.warmup} warm-up + {args.tasks} "
        f"timed tasks; longest conversation {longest} tokens; KV memory {kv_tokens} "
        f"tokens (predd {-(-kv_tokens // PAGE)} pages, vLLM {kv_tokens // VLLM_BLOCK + 1} "
        f"blocks of {VLLM_BLOCK} with its null block)")
    report(args, work, kv_tokens, measure(args, work, kv_tokens))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["lip"]:
        lip_main(sys.argv[2])
    else:
        sys.exit(main())
