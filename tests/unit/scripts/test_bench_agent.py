"""B5's agent bench (scripts/bench_agent.py): its tasks are seeded, and the LIP that
appends only what is new and the client that sends the whole conversation again feed
the model the same tokens. A fake tokenizer and a fake model; no daemon."""
from __future__ import annotations

from types import SimpleNamespace

from scripts import bench_agent


class FakeTokenizer:
    """One id per character (a chat template of role headers), so counts are exact."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def model(context: list[int], n: int) -> list[int]:
    """A deterministic fake LM: each token is a function of everything before it."""
    ctx, out = list(context), []
    for _ in range(n):
        out.append(hash(tuple(ctx)) % 49152)
        ctx.append(out[-1])
    return out


class FakeLip:
    """liblip's calls run_task_lip makes, on lists: `generate` leaves its last token out
    of the cache, as predd's does; every context the model saw is recorded."""
    LipError = RuntimeError

    def __init__(self, system: list[int]) -> None:
        self.caches: dict[int, list[int]] = {0: list(system)}
        self.seen: list[list[int]] = []
        self.sent: list[int] = []
        self.waits = 0

    def kv_fork(self, kv: int) -> int:
        self.caches[len(self.caches)] = list(self.caches[kv])
        return len(self.caches) - 1

    def generate(self, kv: int, tokens, max_tokens: int, sample, ignore_eos: bool):
        assert sample == {"temperature": 0.0} and ignore_eos
        context = self.caches[kv] + list(tokens)
        self.seen.append(context)
        self.sent.append(len(tokens))
        out = model(context, max_tokens)
        self.caches[kv] = context + out[:-1]
        ids = bench_agent.lip.Generated(out)
        ids.cost = {"computed": len(tokens), "reused": len(context) - len(tokens)}
        return ids

    def io_wait(self, kv: int):
        self.waits += 1
        return bench_agent.contextlib.nullcontext()

    def kv_close(self, kv: int) -> None:
        del self.caches[kv]


def workload(seed: int = 0):
    return bench_agent.make_workload(FakeTokenizer(), seed, warmup=2, tasks=3, turns=4,
                                     question_tokens=60, observation_tokens=80)


def test_workload_is_seeded_and_sized():
    a, b, c = workload(0), workload(0), workload(1)
    assert a == b
    assert a.timed != c.timed and a.system == c.system
    system = FakeTokenizer().encode(f"<system>{bench_agent.SYSTEM}</>")
    assert a.system == system
    for t in a.warmup + a.timed:
        assert len(t.observations) == 4
        # the fewest words that reach the target (a word and a space are at most 9 ids)
        assert 60 <= len(t.question) < 60 + 9
        assert all(80 <= len(o) < 80 + 9 for o in t.observations)
    assert len({t.question for t in a.warmup + a.timed}) == 5


def test_lip_and_client_feed_the_model_the_same_tokens(monkeypatch):
    work = workload()
    args = SimpleNamespace(turn_tokens=32, answer_tokens=16, tool_ms=0.0, turns=4)
    fake = FakeLip(work.system)
    monkeypatch.setattr(bench_agent, "lip", SimpleNamespace(
        Generated=bench_agent.lip.Generated, LipError=RuntimeError, kv_fork=fake.kv_fork,
        generate=fake.generate, io_wait=fake.io_wait, kv_close=fake.kv_close))

    prompts: list[list[int]] = []

    def complete(prompt: list[int], n: int) -> list[int]:
        prompts.append(list(prompt))
        return model(prompt, n)
    client = bench_agent.VllmRig.__new__(bench_agent.VllmRig)
    client.args, client.work, client.complete = args, work, complete

    for task in work.timed:
        fake.seen.clear()
        fake.sent.clear()
        prompts.clear()
        ours = bench_agent.run_task_lip(0, task, 32, 16, 0.0)
        theirs = client.submit(task)
        assert ours["tokens"] == theirs["tokens"]
        assert len(ours["tokens"]) == 4 * 32 + 16
        assert fake.seen == prompts and len(prompts) == 5
        assert theirs["sent"] == sum(map(len, prompts))
        # the last prompt is the whole conversation: system, question, 4 x (32 + obs)
        assert len(prompts[-1]) == len(work.system) + len(task.question) + \
            4 * 32 + sum(map(len, task.observations))
        # the LIP sent only the new tokens: the question, then last token + observation
        assert fake.sent == [len(task.question)] + [1 + len(o) for o in task.observations]
        assert ours["computed"] == sum(fake.sent)
        assert list(fake.caches) == [0]          # the fork was closed
    assert fake.waits == 4 * len(work.timed)     # every tool call inside io_wait


def test_longest_counts_the_whole_conversation():
    work = workload()
    want = len(work.system) + max(len(t.question) + sum(map(len, t.observations))
                                  for t in work.warmup + work.timed) + 4 * 32 + 16
    assert work.longest(32, 16) == want
