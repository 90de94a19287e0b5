"""liblip's pred calls against the real predd: one call per kind of answer, each with
exactly one return type, and the answers agree with each other (a sampled or top-k
answer is the raw distribution's)."""
from __future__ import annotations

import numpy as np

VOCAB = 49152
PROMPT = "The capital of France is"


def test_pred_and_pred_outputs_return_raw_distributions(lip):
    tokens = lip.tokenize(PROMPT)
    kv = lip.kv_create()
    d = lip.pred(kv, tokens)
    assert type(d) is lip.Distribution
    assert d.logits.dtype == np.float32 and d.logits.shape == (VOCAB,)
    assert d.cost["computed"] == len(tokens) and d.cost["reused"] == 0
    assert lip.kv_stat(kv)["tokens"] == len(tokens)

    kv2 = lip.kv_create()
    ds = lip.pred_outputs(kv2, tokens, [0, -1])
    assert [type(x) for x in ds] == [lip.Distribution, lip.Distribution]
    assert ds[1].argmax() == d.argmax()
    assert np.abs(ds[1].logits - d.logits).max() <= 1e-4
    first = lip.pred(lip.kv_create(), tokens[:1])
    assert np.abs(ds[0].logits - first.logits).max() <= 1e-4
    assert lip.pred_outputs(kv2, tokens[:2], []) == []      # appended, nothing predicted
    assert lip.kv_stat(kv2)["tokens"] == len(tokens) + 2
    for k in (kv, kv2):
        lip.kv_close(k)


def test_pred_sample_is_the_distributions_and_seeded(lip):
    tokens = lip.tokenize(PROMPT)
    d = lip.pred(lip.kv_create(), tokens)
    greedy = lip.pred_sample(lip.kv_create(), tokens, {"temperature": 0.0})
    assert type(greedy) is lip.Sampled
    assert greedy.token == d.argmax() and greedy.tokens == [greedy.token]
    assert abs(greedy.logprob - float(d.logprobs()[greedy.token])) < 1e-4
    assert greedy.cost["computed"] == len(tokens)

    seeded = {"temperature": 1.0, "seed": 7}
    a = lip.pred_sample(lip.kv_create(), tokens, seeded)
    b = lip.pred_sample(lip.kv_create(), tokens, seeded)
    assert (a.token, a.logprob) == (b.token, b.logprob)
    assert abs(a.logprob - float(d.logprobs()[a.token])) < 1e-4   # at temperature 1

    # Several outputs: the greedy token after each prefix, as the raw rows say.
    rows = lip.pred_outputs(lip.kv_create(), tokens, [0, 2, -1])
    many = lip.pred_sample(lip.kv_create(), tokens, {"temperature": 0.0}, outputs=[0, 2, -1])
    assert many.tokens == [r.argmax() for r in rows] and many.token == rows[-1].argmax()
    assert len(many.logprobs) == 3


def test_pred_topk_is_sorted_and_agrees_with_pred(lip):
    tokens = lip.tokenize(PROMPT)
    d = lip.pred(lip.kv_create(), tokens)
    top = lip.pred_topk(lip.kv_create(), tokens, 5)
    assert type(top) is lip.TopK
    assert len(top.ids) == len(top.logprobs) == 5
    assert top.logprobs == sorted(top.logprobs, reverse=True)
    assert top.ids[0] == d.argmax()
    ref_ids, ref_lps = d.topk(5)
    assert top.ids == ref_ids and np.allclose(top.logprobs, ref_lps, atol=1e-4)
    assert top.per_output == [(top.ids, top.logprobs)]
    assert top.cost["computed"] == len(tokens)

    both = lip.pred_topk(lip.kv_create(), tokens, 3, outputs=[0, -1])
    assert len(both.per_output) == 2 and both.ids == ref_ids[:3]
    # A mask leaves only the allowed ids, in the distribution's order.
    allowed = [ref_ids[4], ref_ids[2]]
    masked = lip.pred_topk(lip.kv_create(), tokens, 2, mask=allowed)
    assert masked.ids == [ref_ids[2], ref_ids[4]]


def test_prefill_appends_at_positions_and_says_what_it_cost(lip):
    tokens = lip.tokenize(PROMPT)
    kv = lip.kv_create()
    cost = lip.prefill(kv, tokens)
    assert cost["computed"] == len(tokens) and cost["reused"] == 0
    assert lip.kv_tokens(kv) == tokens
    assert lip.kv_positions(kv) == list(range(len(tokens)))
    more = lip.tokenize(" Paris")
    at = list(range(100, 100 + len(more)))
    assert lip.prefill(kv, more, positions=at)["computed"] == len(more)
    assert lip.kv_positions(kv) == list(range(len(tokens))) + at
    lip.kv_close(kv)


def test_a_stream_left_early_cancels_its_generate_in_predd(lip):
    prompt = lip.tokenize("Once upon a time, in a land far away,")
    want = list(lip.generate(lip.kv_create(), prompt, max_tokens=200, stop=[]))
    kv = lip.kv_create()
    stream = lip.generate_stream(kv, prompt, max_tokens=200, stop=[])
    seen = [next(stream) for _ in range(3)]
    stream.close()                     # returns once predd has ended the generate
    assert lip.stats()["pending_calls"] == 0
    kept = lip.kv_tokens(kv)[len(prompt):]
    assert seen == want[:3]
    assert 2 <= len(kept) < 199 and kept == want[:len(kept)]
    # the cache goes on as a pred loop would: the last generated token is not appended
    assert lip.pred_sample(kv, [want[len(kept)]], {"temperature": 0.0}).token == \
        want[len(kept) + 1]


def test_generate_into_gives_the_stream_s_tokens_and_stops_where_told(lip):
    """generate_into hands each chunk's tokens to its callback (on the reading thread),
    the same tokens as generate; a callback that returns False stops the generate in
    predd, and the cache holds what a left stream leaves."""
    prompt = lip.tokenize("Once upon a time, in a land far away,")
    want = list(lip.generate(lip.kv_create(), prompt, max_tokens=40, stop=[]))
    given: list[int] = []
    out = lip.generate_into(lip.kv_create(), prompt, lambda ids, lps: given.extend(ids),
                            max_tokens=40, stop=[])
    assert given == want == list(out) and out.finish_reason == "length"
    assert len(out.logprobs) == 40 and out.cost["computed"] > 0
    kv = lip.kv_create()
    seen: list[int] = []
    out = lip.generate_into(kv, prompt, lambda ids, lps: seen.extend(ids) or len(seen) < 3,
                            max_tokens=200, stop=[])
    assert seen == want[:3] and out.finish_reason == ""
    assert lip.stats()["pending_calls"] == 0
    kept = lip.kv_tokens(kv)[len(prompt):]
    assert 2 <= len(kept) < 40 and kept == want[:len(kept)]
