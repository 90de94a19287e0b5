"""B8's Graph-of-Thought bench (scripts/bench_got.py): its problems are seeded, and the
LIP that forks, scores in place and merges caches and the client that sends each call's
whole text feed the model the same token sequences and do the same calls. A fake
tokenizer and a fake model over token lists; no daemon."""
from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from scripts import bench_got
from tests.unit.scripts.fake_lip import FakeLip, FakeTokenizer, model

P = bench_got.Params(branches=4, keep=2, rounds=3, thought_tokens=12, score_tokens=2)


def workload(seed: int = 0):
    return bench_got.make_workload(FakeTokenizer(), seed, warmup=2, tasks=3, branches=4,
                                   problem_tokens=50)


def test_workload_is_seeded_and_sized():
    a, b, c = workload(0), workload(0), workload(1)
    assert a == b
    assert a.timed != c.timed and a.system == c.system
    assert a.hints == [FakeTokenizer().encode(f"\nApproach {i}:") for i in (1, 2, 3, 4)]
    assert a.digits == {ord(str(d)): d for d in range(1, 10)}
    for problem in a.warmup + a.timed:
        assert 50 <= len(problem) < 50 + 9   # the fewest words that reach the target


def test_score_is_the_first_digit_generated():
    digits = {33: 1, 39: 7}
    assert bench_got.score_of([216, 39, 33], digits) == 7
    assert bench_got.score_of([216, 42], digits) == 0


def run_both(monkeypatch, work, problem):
    fake = FakeLip(system=work.system)
    monkeypatch.setattr(bench_got, "lip", fake)
    with ThreadPoolExecutor(4) as pool:
        backend = bench_got.LipBackend(fake.names["system"], pool, len(work.system))
        ours = bench_got.solve(backend, work, list(problem), P)
    prompts: list[list[int]] = []

    def complete_many(batch, n):
        prompts.extend(map(list, batch))
        return [model(p, n) for p in batch]
    args = SimpleNamespace(**vars(P))
    theirs = bench_got.run_task_vllm(complete_many, args, work, problem)
    return fake, backend, ours, theirs, prompts


def test_lip_and_client_feed_the_model_the_same_tokens(monkeypatch):
    work = workload()
    for problem in work.timed:
        fake, backend, ours, theirs, prompts = run_both(monkeypatch, work, problem)
        assert ours == theirs["calls"]
        # per round: 4 candidates, 4 scores, 1 refinement; every call its own length
        assert [len(o) for o in ours] == ([12] * 4 + [2] * 4 + [12]) * 3
        assert Counter(map(tuple, fake.seen)) == Counter(map(tuple, prompts))
        assert theirs["sent"] == sum(map(len, prompts))
        # the LIP computed the problem once, then only each call's new tokens
        assert backend.computed == len(problem) + sum(fake.sent)
        assert fake.open() == []                  # every fork, extract and merge closed


def test_the_aggregate_is_the_context_and_the_best_candidates(monkeypatch):
    work = workload()
    problem = work.timed[0]
    fake, _, ours, _, prompts = run_both(monkeypatch, work, problem)
    context = work.system + list(problem)
    cands = ours[:4]
    scores = [bench_got.score_of(s, work.digits) for s in ours[4:8]]
    best = sorted(range(4), key=lambda i: (-scores[i], i))[:2]
    # the refinement's prompt: C, then each kept candidate's hint and whole thought
    refine = context + [t for i in best for t in work.hints[i] + cands[i]] + work.refine
    assert prompts[8] == refine
    # the next round's candidates continue from the refined context
    assert prompts[9] == refine + ours[8] + work.hints[0]
