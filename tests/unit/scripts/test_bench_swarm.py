"""B9's SWARM bench (scripts/bench_swarm.py): its conversations are seeded, and the LIP
that keeps the conversation's cache once behind each agent's system prompt and the
client that sends the active agent's system prompt and the whole conversation each call
feed the model the same token sequences. A fake tokenizer and a fake model; no daemon."""
from __future__ import annotations

from types import SimpleNamespace

from scripts import bench_swarm
from tests.unit.scripts.fake_lip import FakeLip, FakeTokenizer, model

P = bench_swarm.Params(handoff_tokens=4, call_tokens=6, answer_tokens=10, tool_ms=0.0)


def workload(seed: int = 0, specialists: int = 3):
    return bench_swarm.make_workload(FakeTokenizer(), seed, warmup=2, tasks=4, turns=3,
                                     specialists=specialists, message_tokens=40,
                                     observation_tokens=50)


def test_workload_is_seeded_and_sized():
    a, b, c = workload(0), workload(0), workload(1)
    assert a == b
    assert a.timed != c.timed and a.systems == c.systems
    assert len(a.systems) == 4 and len(workload(specialists=1).systems) == 2
    assert a.handoffs[2] == FakeTokenizer().encode("\nTool: transferred to refunds.\nAgent:")
    for task in a.warmup + a.timed:
        assert len(task) == 3
        for turn in task:
            assert 1 <= turn.agent <= 3
            assert 40 <= len(turn.message) < 40 + 9
            assert 50 <= len(turn.observation) < 50 + 9
    assert len({t.agent for task in a.timed for t in task}) == 3
    assert a.conversation(a.timed[0], P) == sum(
        len(t.message) + len(a.handoffs[t.agent]) + len(t.observation) + 20
        for t in a.timed[0])


def test_lip_and_client_feed_the_model_the_same_tokens(monkeypatch):
    work = workload()
    files = {f"s{i}": s for i, s in enumerate(work.systems)}
    fake = FakeLip(**files)
    monkeypatch.setattr(bench_swarm, "lip", fake)
    systems = [fake.names[f"s{i}"] for i in range(len(work.systems))]
    prompts: list[list[int]] = []

    def complete(prompt, n):
        prompts.append(list(prompt))
        return model(prompt, n)
    args = SimpleNamespace(**vars(P))
    for task in work.timed:
        fake.seen.clear()
        fake.sent.clear()
        prompts.clear()
        backend = bench_swarm.LipBackend(systems, list(map(len, work.systems)))
        ours = bench_swarm.converse(backend, work, task, P)
        theirs = bench_swarm.run_task_vllm(complete, args, work, task)
        assert ours == theirs["calls"]
        assert [len(o) for o in ours] == [4, 6, 10] * 3
        assert fake.seen == prompts and len(prompts) == 9
        # each call: the active agent's system prompt, then the whole conversation
        for turn, k in zip(task, range(0, 9, 3)):
            assert prompts[k][:len(work.systems[0])] == work.systems[0]
            assert prompts[k + 1][:len(work.systems[turn.agent])] == \
                work.systems[turn.agent]
        assert prompts[-1] == work.systems[task[-1].agent] + \
            conversation(work, task, ours)[:-len(ours[-1])]
        assert theirs["sent"] == sum(map(len, prompts))
        # the LIP computed only what is new: each message, handoff and observation, and
        # the last generated token before it
        new = [len(t.message) + len(work.handoffs[t.agent]) + len(t.observation)
               for t in task]
        assert backend.computed == sum(fake.sent) == sum(new) + 3 * len(task) - 1
        assert fake.open() == []                 # conversation and contexts closed
    assert fake.waits == 3 * len(work.timed)     # every tool call inside io_wait


def conversation(work, task, outs) -> list[int]:
    """The whole conversation: per turn message, handoff, call, observation, answer."""
    conv: list[int] = []
    for turn, (h, c, a) in zip(task, zip(outs[::3], outs[1::3], outs[2::3])):
        conv += list(turn.message) + h + work.handoffs[turn.agent] + c + \
            list(turn.observation) + a
    return conv
