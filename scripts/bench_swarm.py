"""B9, SWARM agents: a triage agent hands each customer message off to one of
--specialists (3) agents, each with its own system prompt and tools, all sharing one
conversation (OpenAI Swarm's routines and handoffs); as LIPs that keep the
conversation's cache once and give each agent it behind its own system prompt
(kv_merge), appending only new tokens, against the same agents as a client of vLLM's
OpenAI server (prefix caching on) that sends the active agent's system prompt and the
whole conversation each call, as Swarm does.

A task is a conversation of --turns (3) customer messages (seeded, ~--message-tokens,
30). Each turn:

  triage      the conversation + "\\nCustomer: <message>.\\nAgent:" -> a handoff of
              --handoff-tokens (12)
  specialist  (seeded) + "\\nTool: transferred to <name>.\\nAgent:" -> a tool call of
              --call-tokens (24); the tool waits --tool-ms (50) and returns a seeded
              observation of ~--observation-tokens (60), "\\nTool: ...\\nAgent:"
  specialist  -> the answer, --answer-tokens (48)

Every agent sees its own system prompt (chat template's system turn, ~250 tokens, with
its tools) followed by the whole conversation. Greedy with ignore_eos; the handoffs and
tools are scripted by the seed, so both sides do the same calls and generate the same
number of tokens.

  symphony  --agents LIP processes. Each agent's system prompt is prefilled once into
            a cache file. A task keeps the conversation's cache: when the active agent
            changes, what the last one appended is extracted and merged onto it
            (`kv_extract`, `kv_merge`), and the new agent's context is `kv_merge` of its
            system prompt's cache and the conversation's. So the conversation's
            entries are computed once, after whichever system prompt was active when
            they were added (a cache merge: they do not attend to the new agent's
            prompt); the tool runs inside `lip.io_wait`.
  vllm      each call one /v1/completions with the active agent's system prompt and
            the whole conversation's token ids; its prefix cache holds what the same
            agent saw last, so a handoff computes the conversation since that agent
            last ran (all of it, the first time) behind the new system prompt.

Both sides feed the model the same token sequence at every call; greedy tokens agree
up to the first handoff (`same_tokens_as_baseline` counts the tasks whose first triage
call agrees) and part after it, where the attention differs. RESULT lines
`swarm_latency` (mean seconds per task; ratio = vLLM / Symphony) and `swarm_throughput`
(tasks/s; ratio = Symphony / vLLM; **target >= 1.55** at 8 tasks).

    python scripts/bench_swarm.py [--agents 8] [--tasks 16] [--turns 3] [--tool-ms 50]
        [--systems symphony,vllm,vllm_nocache] [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:      # run as `python scripts/NAME.py`: the packages and scripts.*
    sys.path.insert(0, ROOT)
from scripts import bench_apps  # noqa: E402
from scripts.bench_apps import GREEDY, PAGE, fields_of, generated, lip, seeded_text  # noqa: E402
from scripts.bench_common import log, machine, quick_defaults, serving_flags  # noqa: E402

COMMON = """You work for Harbor Supplies, an online shop, in a team of agents who share \
one conversation with the customer. Be brief and polite, never invent an order, a \
price or a policy, and say what you did. Call a tool by writing tool_name(arguments) \
on its own line; its result comes back on a "Tool:" line."""

AGENTS = {
    "triage": """You are the triage agent. Read the customer's last message and hand \
the conversation to the agent who can help, by calling exactly one transfer tool. Do \
not try to solve the problem yourself. If the request is unclear, ask one short \
question first.

Tools:
- transfer_to_orders(): orders, delivery dates, tracking, changing an address.
- transfer_to_refunds(): returns, refunds, damaged or missing items, charges.
- transfer_to_support(): products that do not work, setup, accounts, passwords.""",
    "orders": """You are the orders agent. You look up orders and change them before \
they ship. Confirm the order number with the customer before any change. Orders ship \
within two working days; an order that has shipped cannot be changed, only returned.

Tools:
- lookup_order(order_id): the order's items, status, address and tracking number.
- change_address(order_id, address): changes the delivery address of an unshipped order.
- track(tracking_number): the carrier's last scan and the expected delivery date.
- transfer_to_triage(): when the customer asks about something else.""",
    "refunds": """You are the refunds agent. Refunds go back to the original payment \
within five working days. Items may be returned within thirty days if unused; damaged \
or missing items are refunded or replaced without a return. Never refund more than the \
order's total.

Tools:
- lookup_order(order_id): the order's items, status, total and payment.
- start_return(order_id, items): a return label for the items, by email.
- refund(order_id, amount, reason): refunds the amount to the original payment.
- transfer_to_triage(): when the customer asks about something else.""",
    "support": """You are the technical support agent. Find out which product and \
what the customer sees, then walk them through one fix at a time and ask whether it \
worked. Offer a replacement through the refunds agent only when the product is faulty.

Tools:
- search_manual(product, question): the manual's section that answers the question.
- reset_account(email): sends a password reset link to the account's email.
- device_status(serial): the device's firmware version and last error.
- transfer_to_triage(): when the customer asks about something else.""",
}
TRIAGE = 0
CUSTOMER = "\nCustomer: {}.\nAgent:"
HANDOFF = "\nTool: transferred to {}.\nAgent:"
OBSERVATION = "\nTool: {}.\nAgent:"


# ------------------------------------------------------------------ workload

@dataclass(frozen=True)
class Turn:
    message: tuple[int, ...]        # the customer's message and the agent's header
    agent: int                      # the specialist triage hands it to (1..)
    observation: tuple[int, ...]    # what that specialist's tool returns


@dataclass
class Workload:
    systems: list[list[int]]        # each agent's system turn; triage first
    handoffs: list[list[int]]       # "transferred to <name>", per agent
    warmup: list[tuple[Turn, ...]]
    timed: list[tuple[Turn, ...]]

    def conversation(self, task: tuple[Turn, ...], p: Params) -> int:
        """The tokens a task's conversation ends with."""
        return sum(len(t.message) + len(self.handoffs[t.agent]) + len(t.observation)
                   for t in task) + len(task) * p.generated

    def peak(self, p: Params) -> int:
        """The most KV one task holds at once besides the system prompts, in tokens:
        the conversation twice (its cache and the active agent's context), a page of
        each copied."""
        return 2 * max(self.conversation(t, p) for t in self.warmup + self.timed) + \
            2 * PAGE


@dataclass(frozen=True)
class Params:
    handoff_tokens: int
    call_tokens: int
    answer_tokens: int
    tool_ms: float

    @property
    def generated(self) -> int:
        return self.handoff_tokens + self.call_tokens + self.answer_tokens


def make_workload(tokenizer, seed: int, warmup: int, tasks: int, turns: int,
                  specialists: int, message_tokens: int, observation_tokens: int) -> Workload:
    """Seeded conversations tokenized by `tokenizer` (predd's: `encode`,
    `apply_chat_template`)."""
    names = list(AGENTS)[:specialists + 1]
    systems = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": COMMON + "\n\n" + AGENTS[name]}], False))
        for name in names]
    rng = random.Random(seed)

    def task() -> tuple[Turn, ...]:
        return tuple(Turn(tuple(seeded_text(tokenizer, CUSTOMER, rng.random(),
                                            message_tokens)),
                          rng.randrange(1, len(names)),
                          tuple(seeded_text(tokenizer, OBSERVATION, rng.random(),
                                            observation_tokens)))
                     for _ in range(turns))
    return Workload(systems, [tokenizer.encode(HANDOFF.format(n)) for n in names],
                    [task() for _ in range(warmup)], [task() for _ in range(tasks)])


def tool(turn: Turn, tool_ms: float) -> list[int]:
    """The specialist's tool: waits as I/O would, returns the turn's observation."""
    time.sleep(tool_ms / 1000)
    return list(turn.observation)


# ------------------------------------------------------------------ the application

def converse(backend, work: Workload, task: tuple[Turn, ...], p: Params) -> list[list[int]]:
    """One task on `backend` (LipBackend or ClientBackend): what each call generated."""
    outputs = []
    try:
        for turn in task:
            outputs.append(backend.step(TRIAGE, list(turn.message), p.handoff_tokens))
            outputs.append(backend.step(turn.agent, work.handoffs[turn.agent],
                                        p.call_tokens))
            with backend.waiting():
                observation = tool(turn, p.tool_ms)
            outputs.append(backend.step(turn.agent, observation, p.answer_tokens))
    finally:
        backend.end()
    return outputs


class LipBackend:
    """The conversation's cache kept once; the active agent's context is its system
    prompt's cache merged with it."""

    def __init__(self, systems: list, lengths: list[int]) -> None:
        self.systems, self.lengths = systems, lengths
        self.conv = self.ctx = None
        self.conv_len = self.ctx_len = self.mark = 0
        self.active = -1
        self.pending: list[int] = []
        self.computed = self.reused = 0

    def _switch(self, agent: int) -> None:
        if self.ctx is not None:
            if self.ctx_len > self.mark:        # what the last agent appended
                new = lip.kv_extract(self.ctx, [(self.mark, self.ctx_len)])
                if self.conv is None:
                    self.conv = new
                else:
                    try:
                        merged = lip.kv_merge([self.conv, new])
                    finally:
                        lip.kv_close(new)
                    lip.kv_close(self.conv)
                    self.conv = merged
                self.conv_len += self.ctx_len - self.mark
            lip.kv_close(self.ctx)
            self.ctx = None
        self.ctx = lip.kv_fork(self.systems[agent]) if self.conv is None else \
            lip.kv_merge([self.systems[agent], self.conv])
        self.ctx_len = self.mark = self.lengths[agent] + self.conv_len
        self.active = agent

    def step(self, agent: int, new: list[int], n: int) -> list[int]:
        if agent != self.active:
            self._switch(agent)
        tokens = self.pending + list(new)
        out = lip.generate(self.ctx, tokens, max_tokens=n, sample=GREEDY, ignore_eos=True)
        ids = generated(out, n)
        self.computed += out.cost.get("computed", 0)
        self.reused += out.cost.get("reused", 0)
        self.ctx_len += len(tokens) + n - 1
        self.pending = [ids[-1]]
        return ids

    def waiting(self):
        return lip.io_wait(self.ctx)      # the caches may move down a tier meanwhile

    def end(self) -> None:
        for kv in (self.ctx, self.conv):
            if kv is not None:
                lip.kv_close(kv)
        self.ctx = self.conv = None


class ClientBackend:
    """Each call the active agent's system prompt and the whole conversation."""

    def __init__(self, complete, systems: list[list[int]]) -> None:
        self.complete, self.systems = complete, systems
        self.conv: list[int] = []
        self.sent = 0

    def step(self, agent: int, new: list[int], n: int) -> list[int]:
        prompt = self.systems[agent] + self.conv + list(new)
        self.sent += len(prompt)
        out = self.complete(prompt, n)
        self.conv += list(new) + out
        return out

    def waiting(self):
        return contextlib.nullcontext()

    def end(self) -> None:
        pass


# ------------------------------------------------------------------ the two sides

def lip_main(*system_paths: str) -> None:
    """A task process: opens each agent's system prompt file, then runs the
    conversations written on stdin (JSON lines) one at a time."""
    systems = [lip.kv_open(path) for path in system_paths]
    lengths = [lip.kv_stat(kv)["tokens"] for kv in systems]

    def run(job: dict) -> dict:
        work = Workload([], job["handoffs"], [], [])
        task = tuple(Turn(tuple(m), a, tuple(o)) for m, a, o in job["turns"])
        backend = LipBackend(systems, lengths)
        outs = converse(backend, work, task, fields_of(Params, job))
        return {"tokens": [t for o in outs for t in o], "calls": outs,
                "computed": backend.computed, "reused": backend.reused}
    bench_apps.serve_jobs(run, ready=lengths)
    for kv in systems:
        lip.kv_close(kv)


def job(args, work: Workload, task: tuple[Turn, ...]) -> dict:
    return {"turns": [[t.message, t.agent, t.observation] for t in task],
            "handoffs": work.handoffs, "handoff_tokens": args.handoff_tokens,
            "call_tokens": args.call_tokens, "answer_tokens": args.answer_tokens,
            "tool_ms": args.tool_ms}


def run_task_vllm(complete, args, work: Workload, task: tuple[Turn, ...]) -> dict:
    backend = ClientBackend(complete, work.systems)
    outs = converse(backend, work, task, fields_of(Params, args))
    return {"tokens": [t for o in outs for t in o], "calls": outs, "sent": backend.sent}


def first_call_agreement(ours, theirs) -> str:
    agree = sum(x["calls"][:1] == y["calls"][:1]
                for x, y in zip(ours.replies, theirs.replies))
    return f"{agree}/{len(ours.replies)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_apps.app_flags(ap, "tasks")
    ap.add_argument("--turns", type=int, default=3, help="customer messages a task")
    ap.add_argument("--specialists", type=int, default=3, choices=range(1, len(AGENTS)))
    ap.add_argument("--message-tokens", type=int, default=30)
    ap.add_argument("--observation-tokens", type=int, default=60)
    ap.add_argument("--handoff-tokens", type=int, default=12)
    ap.add_argument("--call-tokens", type=int, default=24)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--tool-ms", type=float, default=50.0, help="each tool call's wait")
    serving_flags(ap, "a smoke run: 2 tasks at once, 2+2 tasks, 2 turns, 4/8/8-token "
                      "calls (each unless given)")
    args = ap.parse_args()
    quick_defaults(ap, args, {"agents": 2, "tasks": 2, "warmup": 2, "turns": 2,
                              "handoff_tokens": 4, "call_tokens": 8, "answer_tokens": 8})
    bench_apps.parse_systems(ap, args)
    if min(args.agents, args.tasks, args.turns, args.handoff_tokens, args.call_tokens,
           args.answer_tokens) < 1:
        ap.error("counts must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.dtype = machine(args.dtype)

    from predd.model.loader import default_model_path
    from predd.model.tokenizer import load_tokenizer
    work = make_workload(load_tokenizer(default_model_path()), args.seed, args.warmup,
                         args.tasks, args.turns, args.specialists, args.message_tokens,
                         args.observation_tokens)
    p = fields_of(Params, args)
    kv_tokens = bench_apps.kv_tokens_for(args.agents, work.peak(p), map(len, work.systems))
    conv = sorted(work.conversation(t, p) for t in work.timed)
    log(f"bench: system prompts {[len(s) for s in work.systems]} tokens; {args.turns} "
        f"turns of triage ({args.handoff_tokens}) and a specialist ({args.call_tokens} + "
        f"tool {args.tool_ms:g} ms + {args.answer_tokens}); conversations {conv[0]}.."
        f"{conv[-1]} tokens; {args.agents} tasks at once, {args.warmup} warm-up + "
        f"{args.tasks} timed; KV memory {kv_tokens} tokens (predd "
        f"{-(-kv_tokens // PAGE)} pages, vLLM {bench_apps.vllm_blocks(kv_tokens)} blocks)")
    names = list(AGENTS)[:args.specialists + 1]
    measured = bench_apps.measure(
        args, lambda: bench_apps.SymphonyRig(args, __file__, dict(zip(names, work.systems)),
                                             kv_tokens),
        lambda task: job(args, work, task),
        lambda rig, task: run_task_vllm(rig.complete, args, work, task),
        work.warmup, work.timed, kv_tokens)
    bench_apps.report("swarm", measured, kv_tokens, {
        "agents": args.agents, "tasks": args.tasks, "turns": args.turns,
        "specialists": args.specialists, "handoff_tokens": args.handoff_tokens,
        "call_tokens": args.call_tokens, "answer_tokens": args.answer_tokens,
        "tool_ms": args.tool_ms, "system_tokens": [len(s) for s in work.systems],
        "dtype": args.dtype}, same=first_call_agreement)
    return 0


if __name__ == "__main__":
    bench_apps.entry(lip_main, main)
