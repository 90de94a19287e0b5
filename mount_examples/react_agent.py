"""A ReAct agent whose tools run in place, on the same KV cache.

The model writes `Thought:` lines and `Action: tool[argument]` calls; the program runs
the tool (a calculator, a lookup in local documents), appends `Observation: …` to the
very cache the model is writing in, and lets it go on. Nothing is ever prefilled
twice: after the first turn every call computes only its new tokens (the `cost` of
each reply shows `reused` = everything before).

A 135M model does not follow the format by itself, so the program enforces it: it
writes `Thought:` and `Action:` itself, picks the tool with a token mask over the tool
names (predd samples under the mask), and allows `finish` only after a tool has run.

    python mount_examples/react_agent.py "What is 37 * 43?" [--turns 3] [--docs DIR]
"""
from __future__ import annotations

import argparse
import ast
import operator
import re

import liblip as lip
from common import GREEDY, eos_ids, load_docs, write_report

SYSTEM = """Answer the question by thinking step by step and using tools.
Tools: calc[expression] computes arithmetic; lookup[topic] reads a document;
finish[answer] gives the final answer.

Question: What is 12 * 7 + 1?
Thought: I should compute 12 * 7 + 1.
Action: calc[12 * 7 + 1]
Observation: 85
Thought: The result is 85.
Action: finish[85]

Question: What does kvfsd do?
Thought: I should read about kvfsd.
Action: lookup[kvfsd]
Observation: kvfsd presents predd's KV caches as files.
Thought: The document says it.
Action: finish[it presents KV caches as files]"""

DOCS = {
    "predd": "predd owns the model and the KV memory and batches the programs' pred calls.",
    "kvfsd": "kvfsd presents predd's KV caches as files: cp forks, rm frees, du shows memory.",
    "paris": "Paris is the capital of France, on the Seine, with about two million people.",
    "cache": "A KV cache keeps the keys and values of past tokens so they are not recomputed.",
}
TOOLS = ("calc", "lookup", "finish")
STOP = {"a", "an", "the", "of", "is", "in", "on", "and", "what", "who", "how", "does", "do"}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
       ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
       ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calc(expression: str) -> str:
    """Arithmetic only: numbers, + - * / // % ** and parentheses."""
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 64:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")
    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    return str(round(value, 6) if isinstance(value, float) else value)


def lookup(topic: str, docs: dict[str, str]) -> str:
    """The document named by the topic, or else the one sharing most words with it."""
    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z0-9]+", text.lower())) - STOP

    want = words(topic)
    score = {name: (name in want, len(want & words(text))) for name, text in docs.items()}
    best = max(sorted(docs), key=score.__getitem__)
    return docs[best] if any(score[best]) else "no document found"


def run_tool(tool: str, arg: str, docs: dict[str, str] = DOCS) -> str:
    return calc(arg) if tool == "calc" else lookup(arg, docs)


class Agent:
    """The conversation's cache, what is waiting to be appended to it, and what it cost."""

    def __init__(self) -> None:
        self.kv = lip.kv_create()
        self.pending: list[int] = []      # tokens chosen but not yet in the cache
        self.costs: list[dict] = []

    def cached(self) -> int:
        return lip.kv_stat(self.kv)["tokens"]

    def choose(self, text: str, options: dict[str, list[int]]) -> str:
        """Append `text` and let the model pick one option by its first token."""
        firsts = {toks[0]: name for name, toks in options.items()}
        s = lip.pred_sample(self.kv, self.pending + lip.tokenize(text), GREEDY,
                            mask=sorted(firsts))
        self.costs.append(s.cost)
        name = firsts[s.token]
        self.pending = options[name]
        return name

    def write(self, text: str, stop: str, max_tokens: int) -> tuple[str, bool]:
        """Append `text`, then let the model write until `stop` (or max_tokens, or
        EOS). What it wrote before `stop`, and whether it got there."""
        reply = lip.client().call(
            "generate", cap=self.kv.cap, tokens=self.pending + lip.tokenize(text),
            max_tokens=max_tokens, stop_text=[stop], stream=False)
        self.costs.append(reply["cost"])   # lip.generate drops the cost: ask for it raw
        out = reply["tokens"]
        # generate leaves its last token out of the cache; an EOS is not kept at all
        self.pending = [] if out[-1] in eos_ids() else out[-1:]
        said = lip.detokenize([t for t in out if t not in eos_ids()])
        return said.split(stop)[0].strip(), stop in said

    def append(self, text: str) -> dict:
        """Append `text` (a tool's observation) in place; the call's cost."""
        cost = lip.prefill(self.kv, self.pending + lip.tokenize(text))
        self.pending = []
        self.costs.append(cost)
        return cost


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("question")
    ap.add_argument("--turns", type=int, default=3, help="most tool calls before finishing")
    ap.add_argument("--docs", help="a directory of NAME.txt documents for lookup")
    ap.add_argument("--report")
    args = ap.parse_args()
    docs = load_docs(args.docs, DOCS)

    options = {t: lip.tokenize(f" {t}[") for t in TOOLS}
    agent = Agent()
    agent.pending = lip.chat_template([{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": args.question}])
    prompt_len = len(agent.pending)
    turns, answer = [], None
    for turn in range(args.turns + 1):
        thought, ended = agent.write("Thought:", "\n", 24)
        lip.send_to_user(f"Thought: {thought}\n")
        # act at least once; after --turns tool calls, only finish
        names = ("finish",) if turn == args.turns else TOOLS if turns else TOOLS[:2]
        tool = agent.choose("Action:" if ended else "\nAction:",
                            {t: options[t] for t in names})
        arg, ended = agent.write("", "]", 20)
        lip.send_to_user(f"Action: {tool}[{arg}]\n")
        close = "" if ended else "]"
        if tool == "finish":
            answer = arg
            agent.append(close + "\n")
            break
        observation = run_tool(tool, arg, docs)
        before = agent.cached()
        cost = agent.append(f"{close}\nObservation: {observation}\n")
        lip.send_to_user(f"Observation: {observation}\n")
        turns.append({"thought": thought, "tool": tool, "arg": arg,
                      "observation": observation, "cost": cost, "context_before": before})
    lip.send_to_user(f"Answer: {answer}\n")
    tokens = lip.kv_tokens(agent.kv)
    write_report(args.report, {
        "prompt_tokens": prompt_len, "turns": turns, "answer": answer,
        "costs": agent.costs, "cache_tokens": len(tokens),
        "computed_total": sum(c["computed"] for c in agent.costs),
        "transcript": lip.detokenize(tokens)})
    lip.kv_close(agent.kv)


if __name__ == "__main__":
    main()
