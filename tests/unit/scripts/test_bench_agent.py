"""B5's agent bench (scripts/bench_agent.py): its tasks are seeded, and the LIP that
appends only what is new and the client that sends the whole conversation again feed
the model the same tokens. A fake tokenizer and a fake model; no daemon."""
from __future__ import annotations

from types import SimpleNamespace

from scripts import bench_agent
from tests.unit.scripts.fake_lip import FakeLip, FakeTokenizer, model


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
    fake = FakeLip(system=work.system)
    monkeypatch.setattr(bench_agent, "lip", fake)

    prompts: list[list[int]] = []

    def complete(prompt: list[int], n: int) -> list[int]:
        prompts.append(list(prompt))
        return model(prompt, n)

    for task in work.timed:
        fake.seen.clear()
        fake.sent.clear()
        prompts.clear()
        ours = bench_agent.run_task_lip(fake.names["system"], task, 32, 16, 0.0)
        theirs = bench_agent.run_task_vllm(complete, args, work, task)
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
        assert fake.open() == []                 # the fork was closed
    assert fake.waits == 4 * len(work.timed)     # every tool call inside io_wait


def test_longest_counts_the_whole_conversation():
    work = workload()
    want = len(work.system) + max(len(t.question) + sum(map(len, t.observations))
                                  for t in work.warmup + work.timed) + 4 * 32 + 16
    assert work.longest(32, 16) == want
