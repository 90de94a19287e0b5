"""The step's batched greedy pick (predd/engine/outputs.py `pick_greedy`): which calls it serves
(greedy, unmasked generates and pred_samples), that it gives what each call would have
picked alone (`sampling.sample`), and the replies built from it; with predd's kernel and
with torch's fallback."""
from __future__ import annotations

import pytest
import torch

import symphony_protocol as p
from predd.engine import outputs
from predd.engine import sampling
from predd.engine.calls import Call

V = 1000
COST = p.Cost(computed=1, reused=0, pages=1, queue_ms=0.0, step_ms=1.0)
GREEDY = p.SampleParams(temperature=0.0)


def logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4


def call(*blocks: torch.Tensor, **fields) -> Call:
    return Call(1, 1, total=1, tokens=[1], logits=list(blocks), **fields)


def alone(c: Call) -> list[tuple[int, float]]:
    """What the call's rows give picked one by one, as pred_reply picks without the batch."""
    rows = torch.cat(c.logits)
    return [sampling.sample(sampling.apply_mask(row, c.allowed), c.sample or GREEDY, None)
            for row in rows]


@pytest.fixture(params=["kernel", "torch"])
def way(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(outputs, "_cpu_kernels", lambda: None)
    elif outputs._cpu_kernels() is None:
        pytest.skip("predd's CPU kernels do not build here")
    return request.param


def test_greedy_pred_samples_are_picked_with_the_steps_generates(way):
    gen = call(logits(2, 0), generating=True)                       # its last row counts
    two = call(logits(1, 1), logits(1, 2), sample=GREEDY, outputs=[0, 1])   # two outputs
    one = call(logits(1, 3), sample=p.SampleParams(temperature=1e-9))       # greedy too
    want_gen = sampling.sample(gen.logits[-1][-1], GREEDY, None)
    want_two, want_one = alone(two), alone(one)
    outputs.pick_greedy([gen, two, one])
    assert gen.picked[0] == want_gen[0] and gen.picked[1] == pytest.approx(want_gen[1], abs=1e-5)
    for c, want in ((two, want_two), (one, want_one)):
        assert [t for t, _ in c.picks] == [t for t, _ in want]
        assert [lp for _, lp in c.picks] == pytest.approx([lp for _, lp in want], abs=1e-5)
        reply = outputs.pred_reply(c, COST)
        assert isinstance(reply, p.PredSample)
        assert (reply.tokens, reply.logprobs) == ([t for t, _ in c.picks],
                                                  [lp for _, lp in c.picks])


def test_other_preds_are_left_to_their_own_reply(way):
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[5, 7]] = True
    raw = call(logits(1, 4))                                         # raw logits
    topk = call(logits(1, 5), topk=3)
    hot = call(logits(1, 6), sample=p.SampleParams(temperature=1.0, seed=3))
    masked = call(logits(1, 7), sample=GREEDY, allowed=mask)
    outputs.pick_greedy([raw, topk, hot, masked])
    assert all(c.picks is None for c in (raw, topk, hot, masked))
    assert isinstance(outputs.pred_reply(raw, COST), p.PredLogits)
    assert isinstance(outputs.pred_reply(topk, COST), p.PredTopk)
    assert outputs.pred_reply(masked, COST).tokens == [int(torch.argmax(
        masked.logits[0][0].masked_fill(~mask, float("-inf"))))]


def test_a_nan_row_leaves_its_call_to_pick_alone():
    if outputs._cpu_kernels() is None:
        pytest.skip("predd's CPU kernels do not build here")
    bad = logits(2, 8)
    bad[1, 3] = float("nan")
    nan = call(bad, sample=GREEDY, outputs=[0, 1])
    fine = call(logits(1, 9), sample=GREEDY)
    outputs.pick_greedy([nan, fine])
    assert nan.picks is None and fine.picks is not None
    reply = outputs.pred_reply(nan, COST)         # torch's sample, row by row
    assert isinstance(reply, p.PredSample) and len(reply.tokens) == 2
