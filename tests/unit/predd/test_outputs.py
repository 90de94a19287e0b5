"""The step's batched picks (predd/engine/outputs.py `pick_tokens`): which calls each serves
(greedy, unmasked generates and pred_samples by the argmax kernel, the rest by
`sampling.sample_rows`), that they give what each call would have picked alone
(`sampling.sample`), and the replies built from them; with predd's kernel and with
torch's fallback."""
from __future__ import annotations

import pytest
import torch

import symphony_protocol as p
from predd.engine import outputs
from predd.engine import sampling
from predd.engine.calls import Call
from tests.unit.engine_fakes import OnDevice

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
        monkeypatch.setattr(sampling, "cpu_kernels", lambda: None)
    elif sampling.cpu_kernels() is None:
        pytest.skip("predd's CPU kernels do not build here")
    return request.param


def test_greedy_pred_samples_are_picked_with_the_steps_generates(way):
    gen = call(logits(2, 0), generating=True)                       # its last row counts
    two = call(logits(1, 1), logits(1, 2), sample=GREEDY, outputs=[0, 1])   # two outputs
    one = call(logits(1, 3), sample=p.SampleParams(temperature=1e-9))       # greedy too
    want_gen = sampling.sample(gen.logits[-1][-1], GREEDY, None)
    want_two, want_one = alone(two), alone(one)
    outputs.pick_tokens([gen, two, one])
    assert gen.picked[0] == want_gen[0] and gen.picked[1] == pytest.approx(want_gen[1], abs=1e-5)
    for c, want in ((two, want_two), (one, want_one)):
        assert [t for t, _ in c.picks] == [t for t, _ in want]
        assert [lp for _, lp in c.picks] == pytest.approx([lp for _, lp in want], abs=1e-5)
        reply = outputs.pred_reply(c, COST)
        assert isinstance(reply, p.PredSample)
        assert (reply.tokens, reply.logprobs) == ([t for t, _ in c.picks],
                                                  [lp for _, lp in c.picks])


def seeded(seed: int, **fields) -> p.SampleParams:
    return p.SampleParams(seed=seed, **fields)


def test_sampled_and_masked_calls_are_picked_as_alone_and_raw_and_topk_left(way):
    mask = torch.zeros(V, dtype=torch.bool)
    mask[[5, 7]] = True
    raw = call(logits(1, 4))                                         # raw logits
    topk = call(logits(1, 5), topk=3)
    params = [seeded(3, temperature=1.0), seeded(4, temperature=0.7, top_k=20),
              seeded(5, temperature=1.3, top_p=0.5)]
    hot = [call(logits(2, 6 + i), sample=s, outputs=[0, 1],
                generator=sampling.make_generator(s)) for i, s in enumerate(params)]
    masked = call(logits(1, 10), sample=GREEDY, allowed=mask)
    hot_masked = call(logits(1, 11), sample=seeded(6, temperature=2.0), allowed=mask,
                      generator=sampling.make_generator(seeded(6)))
    gen = call(logits(1, 12), generating=True, sample=seeded(7, temperature=1.0),
               generator=sampling.make_generator(seeded(7)))

    def alone_seeded(c: Call) -> list[tuple[int, float]]:
        g = sampling.make_generator(c.sample)
        return [sampling.sample(sampling.apply_mask(row, c.allowed), c.sample, g)
                for row in torch.cat(c.logits)]
    want = {id(c): alone_seeded(c) for c in hot + [masked, hot_masked, gen]}
    outputs.pick_tokens([raw, topk, *hot, masked, hot_masked, gen])
    assert raw.picks is None and topk.picks is None
    assert isinstance(outputs.pred_reply(raw, COST), p.PredLogits)
    assert isinstance(outputs.pred_reply(topk, COST), p.PredTopk)
    for c in hot + [masked, hot_masked]:
        assert c.picks == want[id(c)]
        reply = outputs.pred_reply(c, COST)
        assert (reply.tokens, reply.logprobs) == ([t for t, _ in c.picks],
                                                  [lp for _, lp in c.picks])
    assert masked.picks[0][0] in (5, 7) and hot_masked.picks[0][0] in (5, 7)
    assert [gen.picked] == want[id(gen)] and gen.logits == []
    assert outputs.next_token(gen) == want[id(gen)][0]


def test_a_nan_row_leaves_the_greedy_pick_for_torchs_argmax(way):
    bad = logits(2, 8)
    bad[1, 3] = float("nan")
    nan = call(bad, sample=GREEDY, outputs=[0, 1])
    fine = call(logits(1, 9), sample=GREEDY)
    want = alone(nan)
    outputs.pick_tokens([nan, fine])
    assert [t for t, _ in fine.picks] == [t for t, _ in alone(fine)]   # by the greedy pick
    assert [t for t, _ in nan.picks] == [t for t, _ in want] == [want[0][0], 3]


def test_on_the_cpu_no_row_moves():
    """`to_host` brings a device's rows back; rows on the host stay as they are, even a
    pred_sample's already answered by its picks."""
    answered = call(logits(1, 20), sample=GREEDY)
    raw = call(logits(1, 21), logits(2, 22))
    outputs.pick_tokens([answered])
    kept = [list(answered.logits), list(raw.logits)]
    outputs.to_host([answered, raw])
    assert answered.picks is not None
    assert all(a is b for a, b in zip(answered.logits + raw.logits, kept[0] + kept[1]))
    assert len(answered.logits) == 1 and len(raw.logits) == 2


def test_a_sampled_nan_row_fails_its_call_alone():
    bad = logits(1, 13)
    bad[0, 3] = float("nan")
    s = seeded(1, temperature=1.0)
    nan = call(bad, sample=s, generator=sampling.make_generator(s))
    fine = call(logits(1, 14), sample=s, generator=sampling.make_generator(s))
    outputs.pick_tokens([nan, fine])
    assert nan.picks is None and fine.picks is not None
    with pytest.raises(ValueError, match="no distribution"):
        outputs.pred_reply(nan, COST)


def test_many_sampled_rows_go_a_slice_at_a_time_and_pick_as_alone(monkeypatch):
    monkeypatch.setattr(outputs, "SAMPLE_ROWS", 3)
    s = seeded(9, temperature=1.1, top_p=0.9)
    many = call(logits(4, 15), logits(3, 16), sample=s, outputs=list(range(7)),
                generator=sampling.make_generator(s))
    other = call(logits(1, 17), sample=seeded(10, temperature=0.8),
                 generator=sampling.make_generator(seeded(10)))
    g = sampling.make_generator(s)
    want = [sampling.sample(row, s, g) for row in torch.cat(many.logits)]
    want_other = sampling.sample(other.logits[0][0], other.sample,
                                 sampling.make_generator(other.sample))
    outputs.pick_tokens([many, other])
    assert many.picks == want and other.picks == [want_other]



def test_rows_left_on_a_device_come_to_the_host_in_few_copies(monkeypatch):
    """A step's rows on a device: a pred_sample answered by its picks keeps none; every
    other block comes back, equal, in one copy per HOST_COPY_BYTES; rows already on the
    host stay."""
    def there(t: torch.Tensor) -> OnDevice:
        return t.clone().as_subclass(OnDevice)
    row = V * 4                                   # bytes a row
    monkeypatch.setattr(outputs, "HOST_COPY_BYTES", 3 * row)
    answered = call(there(logits(1, 30)), sample=GREEDY, picks=[(1, -0.5)])
    raw = call(there(logits(1, 31)))
    chunked = call(logits(2, 32), there(logits(1, 33)), outputs=[0, 1, 2])   # host, device
    big = call(there(logits(4, 34)))              # over the limit alone: a copy of its own
    topk = call(there(logits(1, 35)), topk=3)
    want = [torch.cat([t.as_subclass(torch.Tensor) for t in c.logits]).clone()
            for c in (raw, chunked, big, topk)]
    kept = chunked.logits[0]
    OnDevice.copies.clear()
    outputs.to_host([answered, raw, chunked, big, topk])
    assert answered.logits == [] and answered.picks == [(1, -0.5)]
    for c, w in zip((raw, chunked, big, topk), want):
        assert all(type(t) is torch.Tensor for t in c.logits)
        assert torch.equal(torch.cat(c.logits), w)
    assert chunked.logits[0] is kept
    # raw + chunked's device block; big alone; topk
    assert OnDevice.copies == [(2, V), (4, V), (1, V)]


def test_a_calls_rows_from_an_earlier_step_join_the_devices_for_the_batched_pick(monkeypatch):
    """A pred_sample whose outputs span two chunks holds its first chunk's rows on the
    host (`to_host`) and its last on the device: they join the device's for one batched
    pick, with the step's generates, instead of failing it for every call."""
    monkeypatch.setattr(outputs, "_to_device", lambda block, device: block.as_subclass(OnDevice))
    def step():
        spanning = call(logits(2, 40), logits(1, 41).as_subclass(OnDevice), sample=GREEDY,
                        outputs=[0, 1, 2])
        gen = call(logits(1, 42).as_subclass(OnDevice), generating=True)
        return spanning, gen
    spanning, gen = step()
    want = alone(call(logits(2, 40), logits(1, 41), sample=GREEDY))
    assert outputs.pick_tokens([gen, spanning], torch.device("cpu")) == 0
    assert [t for t, _ in spanning.picks] == [t for t, _ in want] and gen.picked is not None
    spanning, gen = step()     # not told the step's device: the devices mix, the pick fails
    assert outputs.pick_tokens([gen, spanning]) == 2 and spanning.picks is None   # both ops
