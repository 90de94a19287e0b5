"""Server-side masks, sampling and top-k on hand-made logits (no model)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from symphony_protocol import SampleParams
from predd.engine import sampling
from tests.unit.helpers import code

LOGITS = torch.tensor([1.0, 3.0, 2.0, 0.0, -1.0, 2.5, 0.5, -2.0, 1.5, 0.25])  # V = 10
V = LOGITS.numel()


def allowed_ids(mask: torch.Tensor) -> list[int]:
    return torch.nonzero(mask).flatten().tolist()


def draw(params: SampleParams, n: int, logits=LOGITS, seed: int = 0) -> list[int]:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return [sampling.sample(logits, params, gen)[0] for _ in range(n)]


# ---------------------------------------------------------------- masks

def test_no_mask():
    assert sampling.mask_tensor(None, V) is None
    assert sampling.apply_mask(LOGITS, None) is LOGITS


def test_mask_as_id_list():
    mask = sampling.mask_tensor([7, 2, 2, 0], V)
    assert mask.dtype == torch.bool and mask.shape == (V,)
    assert allowed_ids(mask) == [0, 2, 7]
    assert allowed_ids(sampling.mask_tensor([V - 1], V)) == [V - 1]


def test_mask_as_little_endian_bitmask():
    # byte 0 bit 0 -> id 0, bit 2 -> id 2; byte 1 bit 1 -> id 9
    mask = sampling.mask_tensor(bytes([0b0000_0101, 0b0000_0010]), V)
    assert allowed_ids(mask) == [0, 2, 9]
    assert allowed_ids(sampling.mask_tensor(b"\xff\x03", V)) == list(range(V))
    assert allowed_ids(sampling.mask_tensor(b"\x00\x80" + b"", 16)) == [15]


def test_bitmask_bits_past_the_vocab_are_ignored():
    assert allowed_ids(sampling.mask_tensor(b"\x10\xfc", V)) == [4]
    assert code(lambda: sampling.mask_tensor(b"\x00\xfc", V)) == "EINVAL"


@pytest.mark.parametrize("mask", [b"", b"\x01", b"\x01\x00\x00\x00\x00", b"\xff" * 8])
def test_bitmask_of_the_wrong_size_is_einval(mask):
    assert code(lambda: sampling.mask_tensor(mask, V)) == "EINVAL"


@pytest.mark.parametrize("mask", [b"\x04\x00\x00", b"\x04\x00\xff\xff"])
def test_bitmask_padded_to_32_bit_words_is_accepted(mask):
    assert allowed_ids(sampling.mask_tensor(mask, V)) == [2]


@pytest.mark.parametrize("mask", [[], b"\x00\x00"])
def test_mask_allowing_nothing_is_einval(mask):
    assert code(lambda: sampling.mask_tensor(mask, V)) == "EINVAL"


@pytest.mark.parametrize("ids", [[-1], [V], [0, V + 5], [0, -(2**40)]])
def test_mask_ids_out_of_range_are_einval(ids):
    assert code(lambda: sampling.mask_tensor(ids, V)) == "EINVAL"


def test_mask_id_beyond_int64_is_einval():
    assert code(lambda: sampling.mask_tensor([2**63], V)) == "EINVAL"


def test_apply_mask():
    mask = sampling.mask_tensor([1, 4], V)
    out = sampling.apply_mask(LOGITS, mask)
    assert out[1] == 3.0 and out[4] == -1.0
    assert all(out[i] == float("-inf") for i in range(V) if i not in (1, 4))
    assert LOGITS[0] == 1.0                  # not in place


# ---------------------------------------------------------------- sampling

def test_greedy_at_temperature_zero():
    token, logprob = sampling.sample(LOGITS, SampleParams(temperature=0.0), None)
    assert token == 1
    assert logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[1]), abs=1e-6)


def test_greedy_with_a_mask_picks_the_best_allowed_and_renormalises():
    masked = sampling.apply_mask(LOGITS, sampling.mask_tensor([0, 3, 8], V))
    token, logprob = sampling.sample(masked, SampleParams(temperature=0), None)
    assert token == 8
    want = 1.5 - torch.logsumexp(torch.tensor([1.0, 0.0, 1.5]), 0)
    assert logprob == pytest.approx(float(want), abs=1e-6)


def test_make_generator():
    assert sampling.make_generator(None) is None
    assert sampling.make_generator(SampleParams(seed=None)) is None
    a = sampling.make_generator(SampleParams(seed=123))
    b = sampling.make_generator(SampleParams(seed=123))
    flat = torch.zeros(1000)
    p = SampleParams(temperature=1.0, seed=123)
    assert [sampling.sample(flat, p, a)[0] for _ in range(20)] == \
           [sampling.sample(flat, p, b)[0] for _ in range(20)]


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    flat = torch.zeros(1000)
    p = SampleParams(temperature=1.0)
    assert draw(p, 20, flat, seed=7) == draw(p, 20, flat, seed=7)
    assert draw(p, 20, flat, seed=7) != draw(p, 20, flat, seed=8)


def test_top_k_one_is_argmax():
    for seed in range(20):
        assert draw(SampleParams(temperature=1.5, top_k=1), 5, seed=seed) == [1] * 5


def test_tiny_top_p_is_argmax():
    for seed in range(20):
        assert draw(SampleParams(temperature=1.5, top_p=1e-6), 5, seed=seed) == [1] * 5


def test_vanishing_top_p_is_argmax():
    assert draw(SampleParams(temperature=1.0, top_p=1e-300), 3) == [1] * 3


def test_vanishing_temperature_is_greedy():
    assert draw(SampleParams(temperature=1e-300), 3) == [1] * 3


def test_top_k_restricts_to_the_k_best():
    picks = draw(SampleParams(temperature=5.0, top_k=2), 200)
    assert set(picks) == {1, 5}              # logits 3.0 and 2.5


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.softmax(LOGITS, -1)
    order = torch.argsort(probs, descending=True).tolist()
    p_top2 = float(probs[order[0]] + probs[order[1]])
    picks = draw(SampleParams(temperature=1.0, top_p=p_top2 - 1e-4), 300)
    assert set(picks) == set(order[:2])
    picks = draw(SampleParams(temperature=1.0, top_p=p_top2 + 1e-4), 300)
    assert set(picks) == set(order[:3])


def test_masked_tokens_are_never_sampled():
    masked = sampling.apply_mask(LOGITS, sampling.mask_tensor([3, 7], V))
    assert set(draw(SampleParams(temperature=3.0), 200, masked)) == {3, 7}


def test_logprob_is_at_temperature_one_whatever_the_temperature():
    logprobs = torch.log_softmax(LOGITS, -1)
    gen = torch.Generator()
    gen.manual_seed(3)
    for _ in range(20):
        token, lp = sampling.sample(LOGITS, SampleParams(temperature=4.0), gen)
        assert lp == pytest.approx(float(logprobs[token]), abs=1e-6)


def test_sampling_follows_the_distribution_roughly():
    two = torch.tensor([0.0, float(torch.log(torch.tensor(3.0)))])   # p = 1/4, 3/4
    picks = draw(SampleParams(temperature=1.0), 2000, two, seed=11)
    assert 0.70 < sum(picks) / len(picks) < 0.80


# ---------------------------------------------------------------- top-k

def test_topk_ids_and_logprobs():
    ids, lps = sampling.topk(LOGITS, 3)
    assert ids == [1, 5, 2]
    want = torch.log_softmax(LOGITS, -1)
    assert lps == pytest.approx([float(want[i]) for i in (1, 5, 2)], abs=1e-6)
    assert lps == sorted(lps, reverse=True)


def test_topk_larger_than_the_vocab_returns_everything():
    ids, lps = sampling.topk(LOGITS, 50)
    assert sorted(ids) == list(range(V)) and len(lps) == V


def test_topk_after_a_mask():
    masked = sampling.apply_mask(LOGITS, sampling.mask_tensor([0, 9], V))
    ids, lps = sampling.topk(masked, 3)
    assert ids[:2] == [0, 9]
    assert lps[2] == float("-inf")


# ---------------------------------------------------------------- a step's rows at once

def test_a_rows_token_does_not_depend_on_the_rows_beside_it():
    rows = torch.randn(12, 3000, generator=torch.Generator().manual_seed(1)) * 3
    params = [SampleParams(temperature=t, top_k=k, top_p=tp, seed=s)
              for s, (t, k, tp) in enumerate([(1.0, 0, 1.0), (0.0, 0, 1.0), (0.6, 50, 1.0),
                                              (1.4, 0, 0.9), (2.0, 7, 0.5), (1e-5, 0, 1.0)] * 2)]
    together = sampling.sample_rows(rows, params, [sampling.make_generator(q) for q in params])
    for row, q, got in zip(rows, params, together):
        assert sampling.sample(row, q, sampling.make_generator(q)) == got
    assert together[1][0] == int(torch.argmax(rows[1]))
    # rows with top-k or top-p (and greedy ones) are torch's: its log_softmax exactly;
    # plain ones the kernel's: float64's to float32's rounding (docs/kernels.md)
    by_torch = torch.log_softmax(rows, -1)
    exact = torch.log_softmax(rows.double(), -1)
    for i, (q, (t, lp)) in enumerate(zip(params, together)):
        if q.temperature >= sampling.MIN_TEMPERATURE and not q.top_k and q.top_p >= 1.0 \
                and sampling.cpu_kernels() is not None:
            want = float(exact[i, t])
            assert abs(lp - want) <= 1.5 * abs(float(np.spacing(np.float32(want)))) + 2e-7
        else:
            assert lp == float(by_torch[i, t])


def test_a_draw_at_the_top_of_the_range_takes_the_last_token_that_can_be_drawn(monkeypatch):
    masked = sampling.apply_mask(LOGITS, sampling.mask_tensor([2, 6], V))   # not V - 1
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(1 - 2 ** -53,
                                                                    dtype=torch.float64))
    assert sampling.sample(masked, SampleParams(temperature=1.0), None)[0] == 6
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.tensor(0.0, dtype=torch.float64))
    assert sampling.sample(masked, SampleParams(temperature=1.0), None)[0] == 2


def test_a_row_that_is_no_distribution_gets_no_token_and_the_others_theirs():
    rows = torch.stack([LOGITS, LOGITS.clone().index_fill_(0, torch.tensor([4]), float("nan"))])
    hot = SampleParams(temperature=1.0, seed=2)
    (token, _), (bad, lp) = sampling.sample_rows(rows, [hot, hot], [None, None])
    assert 0 <= token < V and bad == -1 and lp != lp
    with pytest.raises(ValueError, match="no distribution"):
        sampling.sample(rows[1], hot, None)
