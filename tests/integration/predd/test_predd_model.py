"""predd's numbers against transformers' LlamaForCausalLM from the same GGUF (fp32).

Same logits (max abs diff <= 1e-3) on several prompts — one longer than the step token
budget, so it runs as chunked prefill — and the same greedy tokens over 64 steps, both
through a client-side pred loop and through predd's generate.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import PREDD_ARGS

TOKEN_BUDGET = int(PREDD_ARGS[PREDD_ARGS.index("--max-step-tokens") + 1])
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Symphony serves programs, not prompts. " * 40,   # > token budget: chunked prefill
]


def hf_logits(hf_model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = hf_model(torch.tensor([tokens]))
    return out.logits[0].float().numpy()


def hf_greedy(hf_model, tokens: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "code", "chunked"])
def test_logits_match_transformers(lip, hf_model, prompt):
    tokens = lip.tokenize(prompt)
    if prompt is PROMPTS[2]:
        assert len(tokens) > TOKEN_BUDGET
    kv = lip.kv_create()
    outputs = [0, len(tokens) // 2, len(tokens) - 1]
    dists = lip.pred_outputs(kv, tokens, outputs)
    ref = hf_logits(hf_model, tokens)
    for index, dist in zip(outputs, dists):
        assert dist.logits.dtype == np.float32 and dist.logits.shape == (49152,)
        assert np.abs(dist.logits - ref[index]).max() <= 1e-3
    assert dists[-1].cost["computed"] == len(tokens)
    lip.kv_close(kv)


@pytest.mark.slow
def test_greedy_pred_loop_and_generate_match_transformers(lip, hf_model):
    prompt = lip.chat_template([{"role": "user", "content": "Write a haiku about caches."}])
    expected = hf_greedy(hf_model, prompt, 64)

    kv = lip.kv_create()
    dist = lip.pred(kv, prompt)
    loop = []
    for _ in range(64):
        loop.append(dist.argmax())
        dist = lip.pred(kv, [loop[-1]])
    assert loop == expected
    assert lip.kv_stat(kv)["tokens"] == len(prompt) + 64

    kv2 = lip.kv_create()
    generated = lip.generate(kv2, prompt, max_tokens=64, stop=[], ignore_eos=True)
    assert generated == expected
    # generate leaves the cache as the pred loop would: the last token is not fed.
    assert lip.kv_stat(kv2)["tokens"] == len(prompt) + 63
    assert lip.kv_tokens(kv2) == prompt + expected[:63]

    streamed = list(lip.generate_stream(lip.kv_create(), prompt, max_tokens=64,
                                        ignore_eos=True))
    assert streamed == expected


@pytest.mark.slow
def test_generate_stops_at_eos(lip, hf_model):
    prompt = lip.chat_template([{"role": "user", "content": "Say only the word: yes"}])
    expected = hf_greedy(hf_model, prompt, 48)
    eos = lip.info()["eos_ids"]
    first_eos = next(i for i, t in enumerate(expected) if t in eos)
    out = lip.generate(lip.kv_create(), prompt, max_tokens=48)
    assert out == expected[: first_eos + 1]
    assert out.finish_reason == "stop" and out.cost["computed"] == len(prompt) + first_eos
    capped = lip.generate(lip.kv_create(), prompt, max_tokens=1)
    assert capped.finish_reason == "length" and capped == expected[:1]


def test_server_side_sampling_and_topk(lip):
    tokens = lip.tokenize("The capital of France is")
    kv = lip.kv_create()
    dist = lip.pred(kv, tokens)
    greedy = lip.pred_sample(lip.kv_create(), tokens, {"temperature": 0.0})
    assert greedy.token == dist.argmax()
    assert abs(greedy.logprob - float(dist.logprobs()[dist.argmax()])) < 1e-4
    top = lip.pred_topk(lip.kv_create(), tokens, 5)
    ref_ids, ref_lps = dist.topk(5)
    assert top.ids == ref_ids and np.allclose(top.logprobs, ref_lps, atol=1e-4)
    a = lip.pred_sample(lip.kv_create(), tokens, {"temperature": 1.0, "seed": 7})
    b = lip.pred_sample(lip.kv_create(), tokens, {"temperature": 1.0, "seed": 7})
    assert a.token == b.token
    # The mask constrains: only the allowed ids can come out, with any sampler.
    allowed = [ref_ids[3], ref_ids[4]]
    masked = lip.pred_sample(lip.kv_create(), tokens, {"temperature": 0.0}, mask=allowed)
    assert masked.token == ref_ids[3]
    bits = bytearray(49152 // 8)
    bits[ref_ids[4] // 8] |= 1 << (ref_ids[4] % 8)
    raw = lip.pred(lip.kv_create(), tokens, mask=bytes(bits))
    assert raw.argmax() == ref_ids[4]
    assert np.isinf(raw.logits).sum() == 49151
